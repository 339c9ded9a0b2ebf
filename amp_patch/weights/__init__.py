"""Who owns each weight, and when each copy is valid: the weight layouts (chosen once, ``Properties.weight_layout``).

See :mod:`amp_patch.weights.layouts` for the table; :mod:`.compute_copies` (one owner), :mod:`.masters` and
:mod:`.storage` (two copies), :mod:`.state_dict` (the two-copy state-dict hooks and edit carrying), :mod:`.clip_check`.
"""
