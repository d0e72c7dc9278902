"""distopt inside other training frameworks, one module each, imported only when asked for.

``distopt.integrations.transformers`` (extra ``distopt[hf]``) puts distopt under the Hugging
Face Trainer. Importing this package imports no framework.
"""
