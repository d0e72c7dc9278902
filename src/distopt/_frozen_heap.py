"""The fork server's last preload: what the server imported moves to the garbage collector's
permanent generation, so that a rank's collections do not walk it ([Note: a frozen preload] in
_forkserver.py). Imported for this effect alone, by the server alone."""

import gc

gc.freeze()
