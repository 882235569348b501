"""Train the tiny DeepSeek-V4 for a few steps on random tokens with a hand-written loop."""

import torch

from ttnpu.dsv4 import DeepSeekV4, DeepSeekV4Config, update_expert_bias

torch.manual_seed(0)
config = DeepSeekV4Config.from_flavor("debug")  # or "small", "flash", "pro"
model = DeepSeekV4(config)  # init_weights() already ran
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
tokens = torch.randint(0, config.vocab_size, (2, 64))
for step in range(1, 6):
    terms = model.losses(tokens, torch.roll(tokens, -1, 1))  # total and its parts
    terms.total.backward()  # = model.loss(...): CE + 0.3 MTP + 1e-4 balance + 1.0 indexer KL
    optimizer.step()
    optimizer.zero_grad()
    update_expert_bias(model, rate=1e-3)  # aux-loss-free balancing
    print(f"step {step}: loss {terms.total.item():.3f}")
logits = model(tokens)  # [B, S, vocab]
print(f"logits {tuple(logits.shape)}")
