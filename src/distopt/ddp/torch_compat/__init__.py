"""torch DDP's own spellings taught to distopt's wrapper: its constructor arguments, its methods
(``no_sync``, ``join``, comm hooks, the ignore list), torch's DCP state-dict functions over the
wrapper, ``copy.deepcopy`` refused by name, and ``requires_grad`` toggled after wrapping
([Note: torch DDP's spellings] in ``torch_spellings.py``).

Imports, inside ``ddp/``: ``param_owners.py`` and the lower rooms; never the wrapper, which
brings these in.
"""
