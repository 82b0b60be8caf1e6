"""Device identity (kvcache/runtime/devices.py): one device, one form. ``cuda`` and ``cuda:0`` name one
device and so do ``cpu`` and ``cpu:0``, although ``torch.device`` compares them unequal; a cache
made for either form takes tensors on the device. On the CPU, ``cpu:0`` is the test of the rule
that ``cuda`` breaks on a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import DEVICE, random_ids

import kvcache
from kvcache import PrefixStore
from kvcache.cache import CacheSpec
from kvcache.cache.storages import make_storage
from kvcache.runtime import devices

# The form of the test device that its tensors do not report: cpu:0 on the CPU, cuda on a GPU.
OTHER_FORM = "cpu:0" if DEVICE.type == "cpu" else "cuda"


def test_every_form_of_a_device_is_the_one_its_tensors_report():
    here = torch.empty(0, device=DEVICE).device
    assert torch.device(OTHER_FORM) != here  # what torch itself says
    assert devices.canonical(OTHER_FORM) == devices.canonical(here) == here
    assert devices.same(OTHER_FORM, here) and devices.same(torch.device(OTHER_FORM), str(here))
    assert devices.canonical("meta") == torch.device("meta")
    assert not devices.same("cpu", "meta")


def test_a_spec_made_for_another_form_takes_the_devices_tensors(llama):
    spec = CacheSpec(batch_size=2, num_kv_heads=2, head_dim=16, cache_length=8, dtype=torch.float32,
                     device=OTHER_FORM)
    assert spec.device == torch.empty(0, device=DEVICE).device
    store = make_storage(spec)
    k = torch.randn(2, 2, 3, 16, device=DEVICE)
    store.write_slice(0, k, k, torch.arange(3, device=DEVICE).expand(2, 3))
    assert torch.equal(store.view(3)[0], k)


def test_a_cache_whose_spec_names_another_form_runs_the_model(llama):
    cache = kvcache.make_cache(llama, "window", cache_length=8, batch_size=1)
    cache.spec = dataclasses.replace(cache.spec, device=OTHER_FORM)
    ids = random_ids(10)
    with torch.inference_mode():
        got = llama(ids, cache)
        step = llama.decode(ids[:, -1:], cache)
    assert got.shape == (1, 10, llama.config.vocab_size) and step.shape == (1, llama.config.vocab_size)


def test_a_prefix_store_on_another_form_keeps_entries_where_they_are(llama):
    store = PrefixStore(llama, device=OTHER_FORM)
    assert store.device == torch.empty(0, device=DEVICE).device


@pytest.mark.parametrize("value", ["tpu", "cuda:x"])
def test_a_name_that_is_no_device_is_refused(value):
    with pytest.raises(RuntimeError):
        devices.canonical(value)
