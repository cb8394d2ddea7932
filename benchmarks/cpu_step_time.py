"""Seconds per training step of a model of the tiny default's shape (Qwen2, hidden 128, 2 layers, vocab 1024): the cost
of a CPU pin, e.g. MKL_CBWR=AVX2 against COMPATIBLE (docs/reproducibility.md)."""
import os
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


def main():
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 1024, (32, 256))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    times = []
    for _ in range(15):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    times.sort()
    print(f"MKL_CBWR={os.environ.get('MKL_CBWR')} step median {times[7] * 1000:.1f} ms min {times[0] * 1000:.1f} ms")


if __name__ == "__main__":
    main()
