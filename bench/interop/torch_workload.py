#!/usr/bin/env python3
"""One PyTorch workload under one allocator, in this process: a few training steps of a real
model, timed, with the allocator's peak figures and the losses (to compare allocators: the same
seed and deterministic kernels give the same losses whatever the allocator).

    python3 bench/interop/torch_workload.py --allocator gpupool --model resnet50
    python3 bench/interop/torch_workload.py --allocator native --model bert --record-trace t.pickle

Prints one JSON line. Models are built from their configs (random weights: nothing downloaded):
resnet50 (torchvision, batch 64 of 224x224, SGD), bert (transformers BERT-base masked LM,
batch 32 x 128 tokens, AdamW), bert-varlen (the same, batch 16, a new sequence length in 16..512
every step: what fragments a caching allocator), vit (torchvision vit_b_16, batch 32, AdamW),
resnet50-infer (no_grad inference, batch sizes cycling 1..128; its "loss" is the logits' sum).
bench/interop/torch_allocators.py runs every model under both allocators.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))


def parse():
    parser = argparse.ArgumentParser()
    parser.add_argument("--allocator", choices=["native", "gpupool"], required=True)
    parser.add_argument("--model", choices=["resnet50", "bert", "bert-varlen", "vit", "resnet50-infer"],
                        default="resnet50")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--record-trace", help="(native only) write torch's memory snapshot here")
    return parser.parse_args()


def build(model_name, torch):
    """(model, optimizer or None, a function of the step number giving the loss to minimise)."""
    torch.manual_seed(0)
    if model_name == "resnet50-infer":
        import torchvision
        model = torchvision.models.resnet50().cuda().eval()
        sizes = [1, 8, 32, 64, 128, 16, 4, 96]
        images = {n: torch.randn(n, 3, 224, 224, device="cuda") for n in sizes}

        def infer(step):
            with torch.no_grad():
                return model(images[sizes[step % len(sizes)]]).sum()
        return model, None, infer
    if model_name == "bert-varlen":
        from transformers import BertConfig, BertForMaskedLM
        model = BertForMaskedLM(BertConfig()).cuda()
        generator = torch.Generator().manual_seed(1)
        lengths = torch.randint(16, 513, (1000,), generator=generator).tolist()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def varlen(step):
            tokens = torch.randint(0, 30522, (16, lengths[step]), generator=generator).cuda()
            return model(input_ids=tokens, labels=tokens).loss
        return model, optimizer, varlen
    if model_name == "resnet50":
        import torchvision
        model = torchvision.models.resnet50().cuda()
        inputs = torch.randn(64, 3, 224, 224, device="cuda")
        labels = torch.randint(0, 1000, (64,), device="cuda")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        return model, optimizer, lambda step: torch.nn.functional.cross_entropy(model(inputs), labels)
    if model_name == "vit":
        import torchvision
        model = torchvision.models.vit_b_16().cuda()
        inputs = torch.randn(32, 3, 224, 224, device="cuda")
        labels = torch.randint(0, 1000, (32,), device="cuda")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return model, optimizer, lambda step: torch.nn.functional.cross_entropy(model(inputs), labels)
    from transformers import BertConfig, BertForMaskedLM
    model = BertForMaskedLM(BertConfig()).cuda()
    tokens = torch.randint(0, 30522, (32, 128), device="cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer, lambda step: model(input_ids=tokens, labels=tokens).loss


def main():
    args = parse()
    import torch
    if args.allocator == "gpupool":
        import gpupool.torch
        gpupool.torch.install()
    elif args.record_trace:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True

    model, optimizer, loss_of = build(args.model, torch)
    losses, times = [], []
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = loss_of(step)
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
        losses.append(float(loss.detach()))
        del loss

    result = {"model": args.model, "allocator": args.allocator, "steps": args.steps,
              "ms_per_step_median": statistics.median(times), "losses": losses}
    if args.allocator == "gpupool":
        import gpupool.torch
        stats = gpupool.torch.stats(torch.cuda.current_device())
        result.update(peak_reserved_bytes=stats.peak_reserved_bytes,
                      peak_in_use_bytes=stats.peak_in_use_bytes,
                      allocations=stats.allocations, cache_hits=stats.cache_hits,
                      device_allocations=stats.device_allocations)
    else:
        result.update(peak_reserved_bytes=torch.cuda.max_memory_reserved(),
                      peak_in_use_bytes=torch.cuda.max_memory_allocated(),
                      allocations=torch.cuda.memory_stats()["allocation.all.allocated"],
                      device_allocations=torch.cuda.memory_stats()["segment.all.allocated"])
        if args.record_trace:
            import pickle
            with open(args.record_trace, "wb") as out:
                pickle.dump(torch.cuda.memory._snapshot(), out)
            torch.cuda.memory._record_memory_history(enabled=None)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
