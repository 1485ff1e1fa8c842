"""Train a small model with dpcompile over a torch.distributed DeviceMesh; launch with torchrun.

One node, 2 processes (CPU/gloo; on GPUs the backend is nccl)::

    torchrun --nproc-per-node 2 examples/train_spmd.py                 # data parallel
    torchrun --nproc-per-node 2 examples/train_spmd.py --mode tp       # tensor parallel
    torchrun --nproc-per-node 4 examples/train_spmd.py --mode 2d       # 2 dp x 2 tp

Two nodes, 2 processes each (run on both nodes; NODE0 is the first node's address)::

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 \\
        --rdzv-backend=c10d --rdzv-endpoint=NODE0:29500 examples/train_spmd.py
    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 1 \\
        --rdzv-backend=c10d --rdzv-endpoint=NODE0:29500 examples/train_spmd.py
"""

from __future__ import annotations

import argparse
import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import dpcompile
from dpcompile.mesh import local_batch


class Net(nn.Module):
    def __init__(self, d: int = 32, h: int = 128, classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.bn = nn.BatchNorm1d(h)
        self.fc2 = nn.Linear(h, h)
        self.head = nn.Linear(h, classes)

    def forward(self, x):
        h = torch.relu(self.bn(self.fc1(x)))
        return self.head(torch.relu(self.fc2(h)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["dp", "tp", "2d"], default="dp")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(minutes=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    device_type = "cuda" if use_cuda else "cpu"
    if args.mode == "dp":
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
    elif args.mode == "tp":
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("tp",))
    else:
        mesh = init_device_mesh(device_type, (world // 2, 2), mesh_dim_names=("dp", "tp"))

    torch.manual_seed(0)  # the same model on every rank (DDP would broadcast rank 0's anyway)
    model = Net()
    pm = dpcompile.transform(model, mesh, tensor_parallel=args.mode != "dp")
    if rank == 0:
        print(pm.code)
    opt = torch.optim.SGD(pm.parameters(), lr=0.05)

    # Data parallel: each dp rank takes its own part of the batch; tensor parallel: the same batch.
    gen = torch.Generator().manual_seed(1)
    device = torch.device(device_type, torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    for step in range(args.steps):
        x = torch.randn(args.batch, 32, generator=gen)
        y = torch.randint(0, 10, (args.batch,), generator=gen)
        x, y = local_batch((x.to(device), y.to(device)), mesh)  # (a real job loads only its part)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(pm(x), y)
        loss.backward()
        opt.step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    state = pm.state_dict()  # full tensors, the model's keys (a collective under tensor parallel)
    if rank == 0:
        torch.save(state, "train_spmd_checkpoint.pt")
        print("saved train_spmd_checkpoint.pt:", sorted(state)[:4], "...")
    dist.destroy_process_group()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
