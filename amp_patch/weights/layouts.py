"""Who owns each weight, and when each copy is valid, under every weight layout.

The layout is chosen once, when the policy is resolved (``Properties.weight_layout``,
:func:`amp_patch.config.opt_levels.resolve`), and never changes during a session.

========== ==================================== ====================================== ==========================
layout     the weights the optimizer steps      the half copies                        code
========== ==================================== ====================================== ==========================
none       the model's params (fp32 at O0/O1,   none kept: O1 casts per op through     casting/ (O1), model/
           half at O3)                          the cast cache, valid for one forward  transform (O3's cast)
one_owner  the model's fp32 params (they are    ``p.to(half)`` put in place of each    :mod:`.compute_copies`
           the masters: state_dict, clipping,   param by a forward pre-hook for one
           EMA and load_state_dict see them)    model call, valid only inside it
two_copy   fp32 masters in the optimizer's      the model's half params, valid         :mod:`.masters`,
           param_groups (``amp_patch.           after each step (the masters are        :mod:`.storage`,
           master_params``), kept as fp32 or    copied in); edits made to them reach    :mod:`.state_dict`,
           as bf16 + int16 remainders           the masters before the next step        :mod:`.clip_check`
fsdp2      FSDP2's sharded params (fp32 at O2,  FSDP2's unsharded compute params,       parallel/fsdp2
           half at O3)                          valid inside each FSDP2 forward
========== ==================================== ====================================== ==========================

Hook moments of the two-copy masters (:class:`~amp_patch.weights.masters.TwoCopyMasters`, held by each
``OptimizerState`` as ``masters``; None under every other layout, so no master code runs there):
``attach`` (initialize: masters made, put into param_groups), ``sync_groups`` (a param group added),
``carry_edits`` / ``before_step`` (before each step: edits of the half params reach the masters; remainder storage
joins them), ``after_step`` (the half params get the masters' values; master grads go), ``restore``
(deinitialize: the model params and their optimizer state go back). The one-owner copies' moments are a model
call's start and end (:class:`~amp_patch.weights.compute_copies.ComputeCopies`).
"""

LAYOUTS = ("none", "one_owner", "two_copy", "fsdp2")


def kept_fp32_ids(model, keep_types):
    """Ids of the modules that stay fp32 under every layout: each module of ``keep_types`` (``keep_fp32_modules``,
    batchnorm) with every module inside it (a kept ``MultiheadAttention`` keeps its ``out_proj``)."""
    if not keep_types:
        return set()
    return {id(m) for module in model.modules() if isinstance(module, keep_types) for m in module.modules()}
