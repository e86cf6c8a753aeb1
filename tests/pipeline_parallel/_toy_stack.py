"""The toy model of the schedule tests: a stack of tanh(Linear) layers split into chunks, a
forward step that records the order the schedule runs microbatches in, and its loss.

``EVENTS`` is this process's record: ("F", microbatch, chunk) when a forward step starts,
("B", microbatch, chunk) when the backward reaches a chunk's output. Tests clear it before a run.
"""

import torch

EVENTS: list = []


class Mark(torch.autograd.Function):
    """Identity; records ("B", microbatch, chunk) when the backward reaches it."""

    @staticmethod
    def forward(ctx, x, tag):
        ctx.tag = tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        EVENTS.append(("B",) + ctx.tag)
        return grad, None


class Chunk(torch.nn.Module):
    """One model chunk: ``layers`` applied as tanh(layer(h)) to the input (first stage) or to
    the tensor the schedule set with ``set_input_tensor``."""

    def __init__(self, config, layers, pre_process, vp_stage=0, post_process=False):
        super().__init__()
        self.config, self.pre_process, self.post_process = config, pre_process, post_process
        self.vp_stage = vp_stage
        self.layers = torch.nn.ModuleList(layers)
        self.input_tensor = None

    def set_input_tensor(self, tensors):
        # megatron-core's contract: always a list ([None] on the first stage)
        assert isinstance(tensors, list) and len(tensors) == 1, tensors
        self.input_tensor = tensors[0]

    def forward(self, x):
        h = x if self.pre_process else self.input_tensor
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h


def forward_step(data_iterator, model):
    """megatron-core's forward_step_func: (output, loss_func) for the next (i, x, target)."""
    i, x, target = next(data_iterator)
    EVENTS.append(("F", i, model.vp_stage))
    out = Mark.apply(model(x), (i, model.vp_stage)) * 1.0  # a fresh tensor (deallocatable)

    def loss_func(output):
        loss = ((output - target) ** 2).mean()
        return loss, {"loss": loss.detach().clone()}

    return out, loss_func
