"""One rank: FSDP2 training steps with the native copy-out, then with our kernel (interpreted); equal.

Run by tests/ops/test_split_copy_fsdp.py under torchrun with gloo on CPU processes.
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from magistral_cli.ops import split_copy


def train(steps: int = 2):
    torch.manual_seed(0)
    # Odd sizes, so shards are padded and parameters split unevenly; bf16 and fp32 all-gathers.
    model = torch.nn.Sequential(
        torch.nn.Linear(13, 37),
        torch.nn.GELU(),
        torch.nn.Linear(37, 37),
        torch.nn.GELU(),
        torch.nn.Linear(37, 5),
    )
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model[0], mesh=mesh)
    fully_shard(
        model[2],
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32),
    )
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 13, generator=generator)
        loss = model(x).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), [p.detach().to_local().clone() for p in model.parameters()]


def main():
    dist.init_process_group("gloo")
    native_losses, native_params = train()
    assert split_copy.calls["kernel"] == 0
    with split_copy.triton_interpreter(), split_copy.registered("CPU"):
        losses, params = train()
    used = split_copy.calls["kernel"]
    assert used > 0, f"FSDP2 never called our kernel (fallbacks: {split_copy.calls['native']})"
    assert torch.equal(losses, native_losses), (losses, native_losses)
    assert all(torch.equal(a, b) for a, b in zip(params, native_params, strict=True))
    print(f"rank {os.environ['RANK']} ok kernel_calls={used}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    from magistral_cli.runtime import finish_rank_process

    main()
    finish_rank_process(0)
