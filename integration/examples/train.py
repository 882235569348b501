"""Train the tiny DeepSeek-V4 for a few steps through the Python API (one process, CPU)."""

import os
import tempfile

from torchtitan.tools.logging import init_logger

from ttnpu.trainer import CONFIGS

init_logger()  # torchtitan's step lines (loss, tokens/s, memory) go through its logger
config = CONFIGS["dsv4_debug"]()  # a torchtitan Trainer config, ready to edit
config.training.steps = 3
config.training.seq_len = 64
config.training.local_batch_size = 2
config.device = "cpu"  # or "auto" / "cuda" / "npu"
config.checkpoint.enable = False  # the recipe saves every 20 steps
config.dump_folder = tempfile.mkdtemp(prefix="ttnpu-example-")  # logs and metrics go here
# torchtitan reads its rank from the environment: torchrun sets it; for one process:
os.environ.update(
    RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555"
)
trainer = config.build()  # a DSV4Trainer
try:
    trainer.train()
finally:
    trainer.close()
print(f"trained {trainer.step} steps; run folder {config.dump_folder}")
