"""distopt inside training frameworks, one module each, imported only when asked for.

``distopt.integrations.transformers`` (extra ``torch-distopt[hf]``) puts distopt under the
Hugging Face Trainer; ``distopt.integrations.lightning`` (extra ``torch-distopt[lightning]``) is
a Lightning strategy. Importing this package imports no framework; importing either module
without its extra raises one ImportError that names the command installing it.
"""
