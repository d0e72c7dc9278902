"""torch, imported without its warning that numpy is missing.

distopt needs torch alone (numpy comes only with the extras). Without numpy, ``import torch``
warns "Failed to initialize NumPy" on stderr, and every ``distopt`` command, even one that
stops at once with one line saying what to install, would print that warning first. This
module is imported first by ``distopt/__init__.py``; the filter lasts only while torch is
imported, so nothing of the user's own warning filters changes, and when torch was imported
before distopt, nothing happens here.
"""

import warnings

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch  # noqa: F401
