"""distopt inside training frameworks, one module each, imported only when asked for.

``distopt.integrations.transformers`` (extra ``distopt[hf]``) puts distopt under the Hugging
Face Trainer; ``distopt.integrations.lightning`` (extra ``distopt[lightning]``) is a Lightning
strategy. Importing this package imports no framework.
"""
