from pathlib import Path

import torch

from ttnpu.dsv4 import DeepSeekV4, DeepSeekV4Config, load_pretrained, save_pretrained

model = DeepSeekV4(DeepSeekV4Config.from_flavor("micro"))
save_pretrained(model, "dsv4-hf", layout="hf", shard_bytes=1 << 20)  # transformers' names
loaded = load_pretrained("dsv4-hf")  # layout detected from the names
tokens = torch.randint(0, model.config.vocab_size, (1, 16))
assert torch.equal(loaded(tokens), model(tokens))
print(sorted(p.name for p in Path("dsv4-hf").iterdir())[:3])
