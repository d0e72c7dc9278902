"""What every rank of a group must build alike, compared across the ranks before the first
collective that assumes it: the model (``model.py``) and the optimizer (``optimizer.py``)."""
