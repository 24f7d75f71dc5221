"""Step-cost model of a GPU serving step: profiles, the roofline, KV slots, and its calibrations.

A serving simulator needs::

    from pagedbench.bench.costmodel import StepBatch, StepCostModel, load_hardware, load_model
    cost = StepCostModel.from_profiles(load_model("llama-2-13b"), load_hardware("a100-40gb"))
    cost.step_time_s(StepBatch.of(decode_context_lens=(310, 97), prefill_chunks=((512, 0),)))

and :func:`kv_slot_budget` for the KV capacity. :func:`fit_profile` fits the same model to measured
steps; :mod:`pagedbench.bench.costmodel.vidur_fit` fits the GPU derating to Vidur's profiles;
:mod:`pagedbench.bench.costmodel.host_link` prices KV block copies to and from host memory.
"""

from pagedbench.bench.costmodel.calibration import StepSample, fit_profile
from pagedbench.bench.costmodel.hardware import HardwareProfile, load_hardware
from pagedbench.bench.costmodel.kv_slots import KvSlotBudget, kv_slot_budget
from pagedbench.bench.costmodel.models import ModelProfile, load_model
from pagedbench.bench.costmodel.profile_fields import ProfileError
from pagedbench.bench.costmodel.step_cost import StepBatch, StepCostModel, TensorParallelStepCost

__all__ = [
    "HardwareProfile", "KvSlotBudget", "ModelProfile", "ProfileError", "StepBatch", "StepCostModel",
    "StepSample", "TensorParallelStepCost", "fit_profile", "kv_slot_budget", "load_hardware", "load_model",
]
