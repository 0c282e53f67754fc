"""torch.distributed.pipelining's side of a pipeline-parallel rank: the schedule classes by name
and the stage raymp runs under them. A module of its own so that only a rank that runs a pipeline
imports torch's pipelining, and torch's dynamo with it: importing the driver's or a rank's code
no longer loads them (an FSDP2 rank still loads dynamo at its first step)."""

from __future__ import annotations

from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from raymp.models.moe import moe_blocks, set_counting
from raymp.parallel.pipeline import ActivationMeter, StepClock, autocast_context

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}


def runs_several_stages(schedule: str) -> bool:
    """Whether the schedule takes the rank's list of stages (else its one stage)."""
    return issubclass(SCHEDULES[schedule], PipelineScheduleMulti)


class TimedStage(PipelineStage):
    """A PipelineStage that clocks each action, meters saved activations and, when asked, runs
    forward under autocast (bf16 with ZeRO 0/1; FSDP2 casts by itself)."""

    def __init__(self, *args, clock: StepClock, meter: ActivationMeter, autocast_dtype=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.clock, self.meter, self.autocast_dtype = clock, meter, autocast_dtype
        # torch's schedule runs a stage's forward once more on its first step to infer shapes,
        # outside forward_one_chunk: MoE routing is counted in micro-batch forwards only.
        self.moe_blocks = moe_blocks(self.submod)
        set_counting(self.moe_blocks, False)
        # Set per step when documents are masked: each micro-batch's document ids, handed to the
        # stage's forward here (torch's schedules pass step() keywords to the first stage only).
        self.micro_batch_document_ids = None

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        if self.micro_batch_document_ids is not None:
            kwargs = {**(kwargs or {}), "document_ids": self.micro_batch_document_ids[fwd_chunk_id]}
        set_counting(self.moe_blocks, True)
        try:
            with self.clock.span(self.stage_index, "F", fwd_chunk_id), self.meter.hooks(), \
                    autocast_context(self.device, self.autocast_dtype):
                return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        finally:
            set_counting(self.moe_blocks, False)

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        with self.clock.span(self.stage_index, "B" if full_backward else "I", bwd_chunk_id):
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        with self.clock.span(self.stage_index, "W", bwd_chunk_id):
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
