"""One fixed oracle program per fault class the oracle found (and controls that pass today), so the lead can see
which classes pass once the fixes are merged. Each is the minimal program the class's search in
test_oracle_harness.py shrinks to (or a hand-written one of the same shape). All pass since the fixes of
cast-faults, model-faults and fp32-regions (they were strict xfails until then)."""
import pytest
from oracle_gen import check_close_to_fp32, check_matches_native
from oracle_program import Op, Program, Step
from oracle_run import AmpRunner


def _prog(ops, *steps, dtype="bf16"):
    return Program(dtype=dtype, ops=tuple(ops), steps=tuple(Step(kind, args) for kind, args in steps))


EVAL = ("eval", (0, 0))
TRAIN = ("train", (1, 0))
# .data writes of lin.0.weight (PARAM_NAMES[2]): p.data = w, p.data.copy_(w), vector_to_parameters, p.data.clamp_
DATA_WRITES = {"assign": ("data", (0, 2, 5)), "copy_": ("data", (1, 2, 5)), "vector_to_parameters": ("data", (2, 2, 5)),
               "clamp_": ("data", (3, 2, 5))}


@pytest.mark.parametrize("write", list(DATA_WRITES))
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_stale_cache_after_data_write(write, dtype):
    """Model soups, line search, EMA evaluation: a .data write between two no-grad evaluations."""
    check_matches_native(_prog([Op("lin")], EVAL, DATA_WRITES[write], EVAL, dtype=dtype))


def test_stale_cache_seen_by_a_deepcopy_step():
    check_matches_native(_prog([Op("lin")], EVAL, DATA_WRITES["copy_"], ("deepcopy", (0,))))


@pytest.mark.parametrize("op", ["out_mm", "out_matmul"])
def test_out_buffer_of_an_fp32_call_is_written(op):
    """An fp32 input and an fp32 buffer: native autocast does not cast out= calls, the buffer gets the fp32 result."""
    check_matches_native(_prog([Op(op, 0)], EVAL))


def test_out_call_raises_where_torch_does():
    """A bf16 activation, an fp32 weight and a bf16 buffer: native autocast leaves mm.out alone and torch refuses
    the dtype mix; amp_patch must not cast its way past it."""
    check_matches_native(_prog([Op("lin"), Op("out_mm", 2)], EVAL))


@pytest.mark.parametrize("op", ["out_add", "out_sum", "out_cat"])
def test_out_of_an_op_the_cpu_list_does_not_cast(op):
    """Control: out= on ops outside the torch_cpu list (and cat) already match."""
    check_matches_native(_prog([Op("lin"), Op(op, 1)], EVAL, TRAIN))


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpoint_recomputes_under_the_forward_casting_state(reentrant):
    """A checkpointed segment inside a casting-off region: its recompute (in backward, outside the region) must run
    with casting off as its forward did (reentrant: grads differ; non-reentrant: CheckpointError)."""
    segment = Op("ckpt", 0 if reentrant else 1, (Op("mm"),))
    check_matches_native(_prog([Op("lin"), Op("fp32_region", 0, (segment,))], TRAIN))


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpoint_with_casting_on_matches(reentrant):
    """Control: a checkpointed segment under the session's ordinary casting state matches today."""
    check_matches_native(_prog([Op("lin"), Op("ckpt", 0 if reentrant else 1, (Op("mm"), Op("tanh")))], TRAIN, TRAIN))


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_deepcopy_is_independent_of_the_original(opt_level):
    """An EMA/teacher copy: loading a state dict into the copy must not change the original (O3, which has no
    masters, already passes)."""
    check_close_to_fp32(_prog([Op("lin")], TRAIN, ("deepcopy", (0,)), TRAIN), AmpRunner(opt_level))


def test_deepcopy_under_o1_matches():
    check_matches_native(_prog([Op("lin"), Op("mm")], TRAIN, ("deepcopy", (0,)), TRAIN))


@pytest.mark.parametrize("write", ["copy_", "clamp_"])
def test_o2_weight_edit_survives_the_next_step(write):
    """WGAN weight clipping / weight surgery on an O2 model: the next step's master copy must not undo it."""
    check_close_to_fp32(_prog([Op("lin")], TRAIN, DATA_WRITES[write], TRAIN), AmpRunner("O2"))


@pytest.mark.parametrize("steps", [[("eval", (0, 2)), TRAIN], [TRAIN, ("eval", (0, 2)), TRAIN]],
                         ids=["probe-then-train", "between-steps"])
def test_cast_from_a_forward_without_backward_is_not_reused(steps):
    """A forward with grad on and no backward (a metric, an adversarial probe) between two training steps: its
    cached cast (and its graph) serves the next step, so the weight's grads arrive in another order (1 ulp off
    native autocast, which clears its cache when the region exits) and the old graph stays alive."""
    ops = [Op("fp32_region", 0, (Op("lin"), Op("lin"))), Op("lin")]  # lin0's weight: twice fp32, once cast
    check_matches_native(_prog(ops, *steps))


@pytest.mark.parametrize("op", ["mm", "@", "lin"])
def test_torch_autocast_disabled_region_runs_in_fp32(op):
    """Code written for native autocast forces fp32 with ``torch.autocast(device_type, enabled=False)``
    (transformers' rotary embeddings: ``inv_freq @ position_ids``, in 94 of its model files); under O1 amp_patch
    still casts there: RoPE's cos for positions up to 2047 came out up to 2.0 off in bf16."""
    check_matches_native(_prog([Op("lin"), Op("torch_off", 0, (Op(op),))], TRAIN))


def test_custom_fwd_cast_inputs_runs_in_fp32():
    """``torch.amp.custom_fwd(cast_inputs=torch.float32)`` (the same mechanism: autocast off inside)."""
    check_matches_native(_prog([Op("lin"), Op("custom_fwd_mm")], TRAIN))


@pytest.mark.parametrize("how", [0, 1, 2], ids=["self", "random", "torch.save"])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_state_dict_round_trip(how, opt_level):
    program = _prog([Op("lin"), Op("F.linear")], TRAIN, ("state_dict", (how, 3)), TRAIN, EVAL)
    if opt_level == "O1":
        check_matches_native(program)
    else:
        check_close_to_fp32(program, AmpRunner("O2"))


def test_accumulation_inference_mode_and_inplace_views_match():
    program = _prog([Op("lin"), Op("view_mul_"), Op("t_mm"), Op("iadd")], ("train", (3, 0)), ("eval", (1, 1)),
                    ("train", (2, 4)), dtype="fp16")
    check_matches_native(program)
