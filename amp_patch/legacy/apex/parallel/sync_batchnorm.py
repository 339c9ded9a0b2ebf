"""``apex.parallel.SyncBatchNorm`` and ``convert_syncbn_model`` on ``torch.nn.SyncBatchNorm``.

On CUDA (and any device torch's SyncBatchNorm supports) torch's kernels do the work. torch refuses CPU
tensors in training once a process group exists; there the batch statistics are all-reduced here instead (sums and
sums of squares, all-reduced in forward and their gradients in backward), so gloo runs work too.
``fuse_relu=True`` applies a ReLU after the norm (after adding ``z`` when forward gets one), as Apex's
fused kernel did. ``channel_last=True`` takes Apex's NHWC layout (channels in the last dim, for the module and
``convert_syncbn_model``) and returns that layout; the math is the NCHW one on a moved view.
"""
import torch
import torch.distributed as dist

from ....errors import ConfigError

__all__ = ["SyncBatchNorm", "convert_syncbn_model", "create_syncbn_process_group"]


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Apex's signature: ``SyncBatchNorm(num_features, eps=1e-5, momentum=0.1, affine=True,
    track_running_stats=True, process_group=None, channel_last=False, fuse_relu=False)``.

    A ``_BatchNorm`` as Apex's was (not a ``torch.nn.SyncBatchNorm`` subclass: torch's DDP refuses those on CPU),
    running torch's SyncBatchNorm forward where torch supports the device, so plain
    ``torch.nn.parallel.DistributedDataParallel`` accepts it on CPU (gloo) too."""

    _check_input_dim = torch.nn.SyncBatchNorm._check_input_dim
    _check_non_zero_input_channels = torch.nn.SyncBatchNorm._check_non_zero_input_channels

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_group=None, channel_last=False, fuse_relu=False):
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine,
                         track_running_stats=track_running_stats)
        self.process_group = process_group
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu

    def forward(self, input, z=None):
        if self.channel_last:  # Apex's NHWC layout: channels in the last dim, in and out
            z = None if z is None else z.movedim(-1, 1)
            return self._forward(input.movedim(-1, 1), z).movedim(1, -1).contiguous()
        return self._forward(input, z)

    def _forward(self, input, z):
        sync = self._needs_cpu_sync(input)
        out = self._synced_on_cpu(input) if sync else torch.nn.SyncBatchNorm.forward(self, input)
        if z is not None:
            out = out + z
        return torch.relu(out) if self.fuse_relu else out

    def _needs_cpu_sync(self, x):
        """torch's SyncBatchNorm refuses CPU input in training whenever a process group exists."""
        return x.device.type == "cpu" and self.training and dist.is_available() and dist.is_initialized()

    def _synced_on_cpu(self, x):
        channels, dims = x.size(1), [0] + list(range(2, x.dim()))
        xf = x.float()
        stats = torch.cat([xf.sum(dims), (xf * xf).sum(dims), xf.new_full((1,), xf.numel() // channels)])
        stats = _AllReduceSum.apply(stats, self.process_group or dist.group.WORLD)
        count = stats[-1].detach()
        mean = stats[:channels] / count
        var = stats[channels:2 * channels] / count - mean * mean
        self._update_running_stats(mean.detach(), var.detach(), float(count))
        shape = [1, channels] + [1] * (x.dim() - 2)
        y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.float().view(shape) + self.bias.float().view(shape)
        return y.to(x.dtype)

    def _update_running_stats(self, mean, var, count):
        if not self.track_running_stats:
            return
        with torch.no_grad():
            self.num_batches_tracked += 1
            m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
            unbiased = var * count / max(count - 1.0, 1.0)
            self.running_mean.mul_(1 - m).add_(mean.to(self.running_mean.dtype), alpha=m)
            self.running_var.mul_(1 - m).add_(unbiased.to(self.running_var.dtype), alpha=m)


class _AllReduceSum(torch.autograd.Function):
    """Sum over the ranks; the gradient of a sum of every rank's copies is the sum of their gradients."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def convert_syncbn_model(module, process_group=None, channel_last=False):
    """Replace every batch norm in ``module`` (recursively) by :class:`SyncBatchNorm`, keeping its params and
    running statistics; returns the converted module (a new one when ``module`` itself is a batch norm)."""
    converted = module
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
        converted = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                  module.track_running_stats, process_group, channel_last)
        if module.track_running_stats:
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
        if module.affine:
            with torch.no_grad():
                converted.weight = torch.nn.Parameter(module.weight.detach().clone(),
                                                      requires_grad=module.weight.requires_grad)
                converted.bias = torch.nn.Parameter(module.bias.detach().clone(),
                                                    requires_grad=module.bias.requires_grad)
    for name, child in module.named_children():
        converted.add_module(name, convert_syncbn_model(child, process_group, channel_last))
    return converted


def create_syncbn_process_group(group_size):
    """Split the ranks into consecutive groups of ``group_size``; return this rank's group (None for 0)."""
    if not group_size:
        return None
    world = dist.get_world_size()
    if group_size > world or world % group_size:
        raise ConfigError(f"create_syncbn_process_group({group_size!r}): the group size must divide the world "
                          f"size {world}")
    mine = None
    for start in range(0, world, group_size):
        group = dist.new_group(ranks=list(range(start, start + group_size)))
        if start <= dist.get_rank() < start + group_size:
            mine = group
    return mine
