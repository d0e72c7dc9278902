"""distopt inside training frameworks.

Each submodule plugs distopt into one framework and imports it, so importing this package
imports nothing: ``distopt.integrations.lightning`` needs ``pip install 'distopt[lightning]'``.
"""
