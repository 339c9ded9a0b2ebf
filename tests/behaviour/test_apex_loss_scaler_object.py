"""``apex.amp._amp_state.loss_scalers[i]`` behaves like Apex's plain Python LossScaler object: Apex's attributes
read and write amp_patch's live scaler, any other attribute a script sets is kept (NVIDIA GNMT and BERT lines)."""
import pytest
import torch

import amp_patch
from amp_patch import legacy
from amp_patch.legacy.amp_state import AMP_STATE


@pytest.fixture
def session():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = legacy.amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    yield model, optimizer
    amp_patch.deinitialize()


def _step(model, optimizer, bad=False):
    optimizer.zero_grad()
    loss = model(torch.ones(2, 3)).float().sum() * (float("inf") if bad else 1.0)
    with legacy.amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()


def test_gnmt_sets_the_initial_scale_and_the_growth_interval(session):
    """NVIDIA GNMT's AMPOptimizer: ``_loss_scale = 8192``, ``_scale_seq_len = 128``; the scale doubles after
    128 clean steps, not 2000."""
    model, optimizer = session
    scaler = AMP_STATE.loss_scalers[0]
    scaler._loss_scale = 8192
    scaler._scale_seq_len = 4
    assert amp_patch.session.state.current().scaling.scalers[0].hyperparameters["growth_interval"] == 4
    assert AMP_STATE.loss_scalers[0]._scale_seq_len == 4
    for _ in range(3):
        _step(model, optimizer)
    assert scaler.loss_scale() == 8192 and scaler._unskipped == 3
    _step(model, optimizer)
    assert scaler.loss_scale() == 16384 and scaler._unskipped == 0


def test_bounds_and_dynamic_write_through(session):
    model, optimizer = session
    scaler = AMP_STATE.loss_scalers[0]
    scaler._min_loss_scale = 2.0 ** 15
    scaler._max_loss_scale = 2.0 ** 20
    assert (scaler._min_loss_scale, scaler._max_loss_scale) == (2.0 ** 15, 2.0 ** 20)
    assert AMP_STATE.min_loss_scale == 2.0 ** 15
    _step(model, optimizer, bad=True)
    _step(model, optimizer, bad=True)
    assert scaler.loss_scale() == 2.0 ** 15  # floored at the written minimum
    with pytest.raises(amp_patch.ConfigError):
        scaler._scale_seq_len = 0
    assert scaler._scale_seq_len == 2000  # nothing changed
    scaler.dynamic = False
    _step(model, optimizer, bad=True)
    assert not AMP_STATE.loss_scalers[0].dynamic and scaler.loss_scale() == 2.0 ** 15


def test_a_scripts_own_attribute_is_kept_like_on_a_plain_object(session):
    """NVIDIA BERT's post-accumulation recipe restores the flag through a typo: ``scaler._overfloat_buf = ...``."""
    model, optimizer = session
    scaler = AMP_STATE.loss_scalers[0]
    old = scaler._overflow_buf
    flag = torch.zeros(1, dtype=torch.int)
    scaler._overflow_buf = flag
    assert scaler.update_scale() is False
    scaler._overfloat_buf = old
    assert AMP_STATE.loss_scalers[0]._overfloat_buf is old  # the same object on every read
    assert AMP_STATE.loss_scalers[0]._overflow_buf is flag
    with pytest.raises(amp_patch.UsageError, match="cannot be set"):
        scaler.update_scale = None  # Apex's method: refused, not shadowed


def test_clear_overflow_state_zeroes_the_scripts_flag(session):
    scaler = AMP_STATE.loss_scalers[0]
    flag = torch.ones(1, dtype=torch.int)
    scaler._overflow_buf = flag
    scaler._has_overflow = True
    assert scaler._has_overflow
    scaler.clear_overflow_state()
    assert not scaler._has_overflow and flag.item() == 0


def _accumulate(model, optimizer, micro_batches, bad_at=None):
    """NVIDIA BERT's --allreduce_post_accumulation: every micro-batch exits with delay_overflow_check=True."""
    for i in range(micro_batches):
        loss = model(torch.ones(2, 3)).float().sum() / 1024 * (float("inf") if i == bad_at else 1.0)
        with legacy.amp.scale_loss(loss, optimizer, delay_overflow_check=True) as scaled:
            scaled.backward()


def test_delay_overflow_check_exits_leave_the_update_to_the_scripts_update_scale(session):
    """Apex's handle skipped ``update_scale`` on those exits (``should_skip = False if delay_overflow_check``): only
    the script's own call counts, once per optimizer step, not once per micro-batch."""
    model, optimizer = session
    scaler = AMP_STATE.loss_scalers[0]
    for step in range(3):
        _accumulate(model, optimizer, 4)
        assert scaler._unskipped == step  # the exits counted nothing
        assert scaler.update_scale() is False and scaler._unskipped == step + 1
        optimizer.step()
        optimizer.zero_grad()
    weight = model.weight.detach().clone()
    _accumulate(model, optimizer, 4, bad_at=2)
    assert scaler.loss_scale() == 2.0 ** 16  # nothing backed off at the exits
    assert scaler.update_scale() is True and scaler.loss_scale() == 2.0 ** 15 and scaler._unskipped == 0
    optimizer.step()  # skipped: the script's update_scale() saw the overflow
    assert torch.equal(model.weight, weight) and amp_patch.last_step_skipped(optimizer)
