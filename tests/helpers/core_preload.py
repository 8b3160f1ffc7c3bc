"""What the core environment's worker processes import (the Lightning kill/resume and DDP workers, the second rank of
a two-rank test), imported once in the fork server they are forked from (``preloaded.py``)."""

import lightning.pytorch  # noqa: F401
import modelopt.torch.quantization  # noqa: F401
import torch.distributed  # noqa: F401
from transformers import AutoModelForCausalLM  # noqa: F401

import nemo_fp4qat.lightning
import nemo_fp4qat.qat.controller  # noqa: F401
