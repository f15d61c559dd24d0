"""Optimizers that run on the CPU: the native Adam/AdamW step and the gradient path.

Re-exports only: :class:`CPUAdam` (a ``torch.optim.Optimizer``), :func:`adam_step` (one step
over flat shards, what the engine drives) and :func:`accumulate_grad` (gradient accumulation
with the inf/NaN flag and the sum of squares for clipping, in the same pass).

Note: bytes per parameter.
    The CPU step is memory-bound (a few flops per element against 28+ bytes), so its cost is
    the bytes it moves. Plain fp32 step: read param, grad, exp_avg, exp_avg_sq (16 B) and write
    param, exp_avg, exp_avg_sq (12 B) = 28 B per parameter; its ceiling is the bandwidth of a
    4-read/3-write streaming kernel on the same threads (``offload._C.stream_4r3w``). The engine's
    fused phase reads a bf16 gradient (2 B) and writes a bf16 copy of the parameters (2 B)
    in the same pass: 2 + 12 + 12 + 2 = 28 B. Composed from separate passes (gradient to fp32,
    scale it, fp32 step, copy the parameters out to bf16) the same phase moves 2+4 + 4+4 + 28 +
    4+2 = 48 B or more (plus write-allocate reads), hence the fused kernel's advantage.
    :func:`accumulate_grad` moves 4 + 2..4 + 4 B per element and folds the finite check and the
    sum of squares into that one pass instead of three.
"""

from offload.optim.cpu_adam import CPUAdam
from offload.optim.kernels import accumulate_grad, adam_step

__all__ = ["CPUAdam", "adam_step", "accumulate_grad"]
