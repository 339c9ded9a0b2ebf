"""An old-API Apex script (amp.init / wrap_optimizer / optimizer.scale_loss), run by
tests/behaviour/test_apex_alias_and_run.py."""
import sys

import torch
from apex import amp

amp_handle = amp.init(enabled="--disabled" not in sys.argv, loss_scale="dynamic")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
optimizer = amp_handle.wrap_optimizer(optimizer, num_loss=2)
x = torch.randn(32, 4)
y = x.sum(1, keepdim=True)
for step in range(8):
    optimizer.zero_grad()
    out = model(x)
    print(f"step {step} out_dtype {out.dtype}")
    loss1 = torch.nn.functional.mse_loss(out.float(), y)
    loss2 = 0.1 * out.float().pow(2).mean()
    if step == 3 and amp_handle.is_active():
        loss2 = loss2 * float("inf")  # overflow in the second loss: this step is skipped
    with optimizer.scale_loss(loss1) as scaled:
        scaled.backward(retain_graph=True)
    with optimizer.scale_loss(loss2) as scaled:
        scaled.backward()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    print(f"step {step} loss {loss1.item():.6f} unchanged {unchanged}")
amp_handle._deactivate()
print(f"active_after_deactivate {amp_handle.is_active()}")
