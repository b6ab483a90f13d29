"""What ``Packer.train`` takes and gives back, as the floors above see it (``packer.api.jobs``).

The training loop's protocol: a ``SlotJob`` (an ``AdapterSpec``, its data stream and the caller's key) goes into a
free slot, every step reports a ``StepReport`` per slot, a job leaving its slot is a ``SlotEnd``, and the call
returns its ``TrainResult`` (whose ``step`` is one of ``STEP_NAMES``). They are defined beside the loop that uses
them (``packer.step.jobs``, with the loop's own bookkeeping: its micro-batch windows and loss tallies); this module
names the five a caller needs, so the face is one namespace, not five names, and loading it imports no torch.
"""

from __future__ import annotations

from lora_sweep.packer.step.jobs import STEP_NAMES, SlotEnd, SlotJob, StepReport, TrainResult

__all__ = ["STEP_NAMES", "SlotEnd", "SlotJob", "StepReport", "TrainResult"]
