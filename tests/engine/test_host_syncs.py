"""Host synchronisations per training step, counted on the CPU by value lineage (testing.host_sync).

On a GPU each read of a device value on the host stalls the launch queue. The trainer's step
makes exactly one by design: the finiteness check before AdamW writes the weights, which brings
back the step's log values in the same read (``read_step_values``). Everything
else it needs on the host (token counts, image-token counts, right padding, image sizes, packing
offsets) it reads from the loader's host batches before they move to the device.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from magistral_cli.engine.step_log import read_step_values
from magistral_cli.engine.trainer import Trainer
from magistral_cli.testing.host_sync import HostSyncCounter

from .helpers import make_recipe, write_tiny_model

pytestmark = [pytest.mark.compat, pytest.mark.slow]


def test_the_counter_tells_device_reads_from_host_reads():
    weight = torch.nn.Parameter(torch.ones(3))
    batch = torch.tensor([1.0, 2.0, 0.0])
    with HostSyncCounter(host=[batch]) as counter:
        int((batch > 0).sum())  # host data: free
        torch.zeros(2).tolist()  # a host factory: free
        moved = batch.to("cpu")  # a device copy, even where "the device" is the CPU
        assert moved is not batch
        loss = (weight * moved).sum()
        loss.item()  # a device value
        bool(torch.isfinite(loss))  # a device value
        weight[moved > 0]  # a data-dependent shape from a device mask
        torch.ones((), device="cpu").item()  # a factory given a device: counted (errs high)
    sites = dict(counter.sites)
    assert counter.count == 4, sites
    assert any(s.startswith("item at") for s in sites)
    assert any(s.startswith("boolean index") for s in sites)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-model")
    write_tiny_model(directory)
    return directory


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_training_step_reads_the_device_once(tiny, tmp_path, accumulation):
    # One sample per micro-batch: the synthetic source gives every other sample an image.
    recipe = make_recipe(
        tiny, tmp_path / "run", micro_batch_size=1, gradient_accumulation_steps=accumulation, train_iters=8
    )
    trainer = Trainer(recipe)
    per_step, with_images, without_images = [], 0, 0
    try:
        # One counter for every step: the optimizer's state made in the first step keeps its lineage.
        with HostSyncCounter() as counter:
            for _ in range(4):
                batches = [trainer._next_micro_batch() for _ in range(accumulation)]
                with_images += sum("pixel_values" in b for b in batches)
                without_images += sum("pixel_values" not in b for b in batches)
                counter.mark_host(v for b in batches for v in b.values() if isinstance(v, torch.Tensor))
                counter.sites.clear()
                trainer.train_step(batches)
                per_step.append(dict(counter.sites))
    finally:
        trainer.close()
    assert with_images and without_images, "the synthetic batches should hold both kinds of micro-batch"
    # The one read: read_step_values, which brings back the finiteness inputs and the log values.
    lines, first = inspect.getsourcelines(read_step_values)
    read_line = first + next(i for i, line in enumerate(lines) if ".tolist()" in line)
    for sites in per_step:
        assert sites == {f"tolist at step_log.py:{read_line}": 1}, sites


def test_the_step_values_come_back_exact_in_one_read():
    big = 2**60 + 12345  # beyond float64's exact integers
    counts = torch.tensor([7, big, 2**53 + 1], dtype=torch.int64)
    with HostSyncCounter() as counter:
        host = read_step_values(torch.tensor(1.5), torch.tensor(float("nan")), counts.to("cpu"))
    assert counter.count == 1, dict(counter.sites)
    assert host["counts"] == [7, big, 2**53 + 1]
    assert host["grad_norm"] == 1.5 and host["loss_sum"] != host["loss_sum"]  # NaN comes back as NaN
