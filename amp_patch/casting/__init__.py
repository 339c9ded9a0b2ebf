"""O1 casting: op lists, where their ops live in torch, the reversible patches and the wrappers installed there.

* :mod:`.oplist`: load, validate and layer the YAML op lists (``OpEntry``, ``OpTable``, ``load_op_lists``,
  ``shipped_names``; re-exported by ``amp_patch``); :mod:`._yaml` is its line-numbering safe loader.
* :mod:`.resolve`: op-list targets and names to torch objects, and what may be patched.
* :mod:`.scopes`: the ``scopes:`` section (module-path globs with their own categories) and its run-time state.
* :mod:`.patcher`: ``Patcher``, exactly reversible attribute patches, and ``find_site``.
* :mod:`.wrappers`: what runs in place of a patched op (half/float/promote wrappers, ``HALF_DTYPES``,
  ``cast_tree``, ``iter_tensors``); :mod:`.cache`: the cast cache, used only inside a region amp_patch knows.
* :mod:`.engine`: ``CastingEngine``, an op table turned into installed wrappers and back.
* :mod:`.early_bound`: functions captured before ``initialize`` (``from torch... import name``) that bypass it.
* :mod:`.registry`: the user's ``register_*_function`` / ``*_function`` / ``disable_casts`` (Apex API).
* :mod:`.regions`: ``amp_patch.autocast()``, O1 casting for a region or a function.

Importing this package imports none of them: no YAML is read and nothing is patched.
"""
