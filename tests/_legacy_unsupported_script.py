"""An Apex script that uses Apex's internal LossScaler class (unsupported): the run must fail with a helpful error."""
import torch
from apex import amp

model = torch.nn.Linear(2, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
print("loss scale", amp._amp_state.loss_scalers[0].loss_scale())
from apex.amp.scaler import LossScaler  # noqa: E402

LossScaler("dynamic")
