"""``OffloadTrainer``: Hugging Face ``Trainer`` for a model wrapped by offload.

Use it as ``Trainer``, with the pair ``wrap`` (or ``from_pretrained``) returned::

    model, optimizer = offload.from_pretrained(path, config)
    trainer = offload.OffloadTrainer(model=model, args=args, train_dataset=data,
                                     optimizers=(optimizer, scheduler_or_None))

What it changes (``offload.api.clipping``): ``max_grad_norm`` clips through
``optimizer.clip_grad_norm_`` and the logged ``grad_norm`` is the real one whatever the placement
(a plain ``Trainer`` would get no gradient from the parameters and is stopped by the guard);
with fp16 compute the loss is scaled (``optimizer.scale_loss``) before its backward.
The model is never moved to ``args.device``: its homes own the parameters and inputs are moved
by offload's hooks.
"""

from __future__ import annotations

import transformers

from offload.api.clipping import route_clipping
from offload.api.optimizer import OffloadOptimizer


class OffloadTrainer(transformers.Trainer):
    def __init__(self, *args, **kwargs) -> None:
        optimizers = kwargs.get("optimizers") or (None, None)
        if not isinstance(optimizers[0], OffloadOptimizer):
            raise TypeError(
                "OffloadTrainer: pass optimizers=(optimizer, scheduler) with the optimizer "
                "offload.wrap / offload.from_pretrained returned (scheduler may be None); got "
                f"{type(optimizers[0]).__name__}"
            )
        self._offload_optimizer = optimizers[0]
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        route_clipping(self.accelerator)
        # offload's homes own the parameters: Accelerate must not move the model
        self.accelerator.device_placement = False
        # fp16 (offload's dtype, not Accelerate's): the loss is scaled as the optimizer's step
        # and clipping expect (they divide by the scale); Trainer's plain backward left the
        # gradients 65536x small, the logged grad_norm too, and clipping never applied
        backward, scale = self.accelerator.backward, self._offload_optimizer.scale_loss
        self.accelerator.backward = lambda loss, **kwargs: backward(scale(loss), **kwargs)

    def _move_model_to_device(self, model, device) -> None:
        pass  # see create_accelerator_and_postprocess
