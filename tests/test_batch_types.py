"""Batch signatures see the tensors inside any container a batch comes in (H21).

A batch may be a ``Mapping`` that is not a ``dict`` (HF's ``BatchEncoding`` is a
``UserDict``), a dataclass, a namedtuple or nested lists: a short last batch of
such a type must leave the stance before its step (a re-arm for an unseen batch
signature), not through Dynamo's miss.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, UserDict, UserList
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import lightning as L
import pytest
import torch
from helpers import TinyModule, assert_same_run, guard, make_trainer
from torch.utils.data import DataLoader, TensorDataset

from guardtrain.signatures import batch_signature, describe_signature


class BatchEncoding(UserDict):
    """Stands in for ``transformers.BatchEncoding``, which is ``class BatchEncoding(UserDict)``."""


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass(frozen=True)
class FrozenBatch:
    x: torch.Tensor
    y: torch.Tensor


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class WithDerived:
    """A dataclass with a field that its constructor does not take."""

    x: torch.Tensor
    y: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.y = self.x[:, :1]


class StrictMapping(Mapping):
    """A read-only mapping whose constructor ``apply_to_collection`` cannot call."""

    def __init__(self, *, items: dict[str, Any]) -> None:
        self._items = items

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def _t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


# Each maker builds a batch of one container type; `n` is the batch size of one inner tensor.
MAKERS: dict[str, Callable[[int], Any]] = {
    "tuple": lambda n: (_t(n, 8), _t(n, 1)),
    "list": lambda n: [_t(n, 8), _t(n, 1)],
    "dict": lambda n: {"x": _t(n, 8), "y": _t(n, 1)},
    "dict_of_nested_list": lambda n: {"x": [_t(4, 8), [_t(n, 8), _t(4)]], "y": _t(4, 1)},
    "list_of_lists": lambda n: [[_t(4, 8), _t(4, 1)], [_t(n, 8)]],
    "ordered_dict": lambda n: OrderedDict(x=_t(n, 8), y=_t(n, 1)),
    "namedtuple": lambda n: Pair(_t(n, 8), _t(n, 1)),
    "namedtuple_in_list": lambda n: [Pair(_t(4, 8), _t(n, 1))],
    "dataclass": lambda n: Batch(_t(4, 8), _t(n, 1)),
    "frozen_dataclass": lambda n: FrozenBatch(_t(4, 8), _t(n, 1)),
    "userdict": lambda n: BatchEncoding(x=_t(4, 8), y=_t(n, 1)),
    "userdict_of_nested": lambda n: BatchEncoding(x=[_t(4, 8), {"m": _t(n)}], y=_t(4)),
    "dataclass_of_userdict": lambda n: Batch(BatchEncoding(ids=_t(n, 8)), _t(4, 1)),
    "dict_of_dataclass": lambda n: {"a": Batch(_t(4, 8), _t(n, 1))},
    "dataclass_of_frozen": lambda n: Batch(FrozenBatch(_t(4, 8), _t(n, 1)), _t(4, 1)),
    "dataclass_init_false": lambda n: WithDerived(_t(n, 8)),
    "mapping": lambda n: StrictMapping(items={"x": _t(4, 8), "y": [_t(n, 1)]}),
    "userdict_of_strict_mapping": lambda n: BatchEncoding(m=StrictMapping(items={"a": _t(n)})),
    "userlist": lambda n: UserList([_t(4, 8), [_t(n, 1)]]),
}


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_signature_is_hashable_and_equal_for_equal_metadata(kind: str) -> None:
    a, b = batch_signature(MAKERS[kind](16)), batch_signature(MAKERS[kind](16))
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_signature_changes_with_one_inner_shape(kind: str) -> None:
    full, short = batch_signature(MAKERS[kind](16)), batch_signature(MAKERS[kind](5))
    assert full != short


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_values_do_not_count_and_dtype_does(kind: str) -> None:
    before = batch_signature(MAKERS[kind](16))
    with torch.no_grad():
        ones = MAKERS[kind](16)
        for t in _tensors(ones):
            t.fill_(1.0)
    assert batch_signature(ones) == before
    halves = MAKERS[kind](16)
    _tensors(halves)[-1].data = torch.zeros(_tensors(halves)[-1].shape, dtype=torch.float16)
    assert batch_signature(halves) != before


def _tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor in ``batch``, in order (a walk written for the tests, not the library's)."""
    found: list[torch.Tensor] = []
    if isinstance(batch, torch.Tensor):
        found.append(batch)
    elif dataclasses.is_dataclass(batch):
        for f in dataclasses.fields(batch):
            found += _tensors(getattr(batch, f.name))
    elif isinstance(batch, Mapping):
        for v in batch.values():
            found += _tensors(v)
    elif isinstance(batch, Sequence):
        for v in batch:
            found += _tensors(v)
    return found


def test_container_type_counts() -> None:
    x, y = _t(16, 8), _t(16, 1)
    sigs = [
        batch_signature((x, y)),
        batch_signature([x, y]),
        batch_signature(Pair(x, y)),
        batch_signature(Batch(x, y)),
        batch_signature({"x": x, "y": y}),
        batch_signature(BatchEncoding(x=x, y=y)),
    ]
    assert len(set(sigs)) == len(sigs)


def test_mapping_keys_count() -> None:
    x, y = _t(16, 8), _t(16, 8)
    assert batch_signature(BatchEncoding(a=x, b=y)) != batch_signature(BatchEncoding(a=x, c=y))
    assert batch_signature(BatchEncoding(a=x, b=y)) != batch_signature(BatchEncoding(b=y, a=x))
    assert batch_signature({"a": x, "b": y}) != batch_signature({"a": x, "c": y})


def test_tensor_count_counts() -> None:
    x = _t(16, 8)
    assert batch_signature(BatchEncoding(a=[x, x])) != batch_signature(BatchEncoding(a=[x]))
    assert batch_signature(Batch([x, x], x)) != batch_signature(Batch([x], x))


def test_non_tensor_leaves_count_by_type_only() -> None:
    x = _t(16, 8)
    assert batch_signature((x, 1)) == batch_signature((x, 2))
    assert batch_signature(BatchEncoding(a=x, n=1)) == batch_signature(BatchEncoding(a=x, n=2))
    assert batch_signature(Batch(x, "a")) == batch_signature(Batch(x, "b"))  # type: ignore[arg-type]


def test_other_objects_count_by_type() -> None:
    class Opaque:
        def __init__(self) -> None:
            self.x = _t(16, 8)

    assert batch_signature(Opaque()) == batch_signature(Opaque())
    assert batch_signature(None) == batch_signature(None)


def test_the_flat_fast_paths() -> None:
    x, y = _t(16, 8), _t(16, 1)
    metas = ((x.shape, x.dtype, x.device), (y.shape, y.dtype, y.device))
    assert batch_signature((x, y)) == (tuple, metas)
    assert batch_signature([x, y]) == (list, metas)
    assert batch_signature({"x": x, "y": y}) == (dict, (("x", metas[0]), ("y", metas[1])))


def test_the_mixed_fast_paths_give_the_general_signature() -> None:
    """A tuple, list or dict of tensors and plain values (a model call's keyword
    arguments) reads its tensors in place and gives what the member-by-member path gives;
    arrays with a shape, dtype and device (NumPy's) keep their metadata."""
    import numpy as np

    x = _t(16, 8)
    meta = (x.shape, x.dtype, x.device)
    kwargs = {"input_ids": x, "use_cache": True, "past_key_values": None, "n": 3}
    assert batch_signature(kwargs) == (
        dict,
        (("input_ids", meta), ("use_cache", bool), ("past_key_values", type(None)), ("n", int)),
    )
    assert batch_signature((x, 1, [x])) == (tuple, (meta, int, (list, (meta,))))
    a, b = np.zeros((3, 2)), np.zeros((4, 2))
    assert batch_signature([a, a]) != batch_signature([b, a])
    assert batch_signature({"a": a}) != batch_signature({"a": b})
    # Beside plain values too: an array's shape counts, where a member read by its type
    # alone would hide it.
    assert batch_signature((a, "train", 3)) != batch_signature((b, "train", 3))
    assert batch_signature({"a": a, "n": 3}) == (
        dict,
        (("a", (a.shape, a.dtype, a.device)), ("n", int)),
    )


class _AnyAttribute(dict):  # type: ignore[type-arg]
    """A dict whose attributes never fail (addict's, Box's): no array, a dict."""

    def __getattr__(self, name: str) -> Any:
        return _AnyAttribute()


class _Image:
    """Not an array: a ``shape`` property beside other tensors."""

    def __init__(self, pixels: torch.Tensor, mask: torch.Tensor) -> None:
        self.pixels, self.mask = pixels, mask

    @property
    def shape(self) -> Any:
        return self.pixels.shape


def test_only_arrays_count_by_their_own_metadata() -> None:
    """A member that merely answers ``shape`` (any attribute, or a property beside other
    tensors) is read as any other object: a dict recursed into, the rest as before."""
    x = _t(4, 2)
    got = batch_signature({"b": _AnyAttribute(x=x), "n": 1})
    hash(got)
    assert got == (
        dict,
        (("b", (_AnyAttribute, (("x", (x.shape, x.dtype, x.device)),))), ("n", int)),
    )
    # Read as any object (by its type), not as an array of the pixels' shape alone.
    assert batch_signature((_Image(x, _t(4)), 1)) == (tuple, (_Image, int))


@pytest.mark.parametrize(
    ("batch", "expected"),
    [
        ((_t(4, 8), _t(4, 1)), "((4, 8) float32 cpu, (4, 1) float32 cpu)"),
        ({"x": _t(4, 8)}, "{'x': (4, 8) float32 cpu}"),
        (
            {"x": [_t(4, 8), _t(4)], "n": 3},
            "{'x': ((4, 8) float32 cpu, (4,) float32 cpu), 'n': int}",
        ),
        (Pair(_t(4, 8), _t(4, 1)), "Pair((4, 8) float32 cpu, (4, 1) float32 cpu)"),
        (
            BatchEncoding(input_ids=_t(4, 8, dtype=torch.int64), mask=_t(4, 8, dtype=torch.int64)),
            "BatchEncoding{'input_ids': (4, 8) int64 cpu, 'mask': (4, 8) int64 cpu}",
        ),
        (
            BatchEncoding(input_ids=[_t(4, 8), _t(4, 8)]),
            "BatchEncoding{'input_ids': [(4, 8) float32 cpu, (4, 8) float32 cpu]}",
        ),
        (Batch(_t(4, 8), _t(4, 1)), "Batch(x=(4, 8) float32 cpu, y=(4, 1) float32 cpu)"),
        (  # the tensors nested in one member read as a list
            Batch(BatchEncoding(ids=_t(4, 8)), _t(4, 1)),
            "Batch(x=[(4, 8) float32 cpu], y=(4, 1) float32 cpu)",
        ),
        (FrozenBatch(_t(4, 8), 3), "FrozenBatch(x=(4, 8) float32 cpu, y=int)"),  # type: ignore[arg-type]
        (OrderedDict(x=_t(4)), "OrderedDict{'x': (4,) float32 cpu}"),
        (UserList([_t(4), [_t(2)]]), "UserList[(4,) float32 cpu, (2,) float32 cpu]"),
        (object(), "object"),
        (  # apply_to_collection cannot rebuild these: they are read member by member
            Batch(FrozenBatch(_t(4, 8), _t(4, 1)), StrictMapping(items={"a": _t(2)})),
            "Batch(x=FrozenBatch(x=(4, 8) float32 cpu, y=(4, 1) float32 cpu),"
            " y=StrictMapping{'a': (2,) float32 cpu})",
        ),
    ],
)
def test_describe_signature(batch: Any, expected: str) -> None:
    assert describe_signature(batch_signature(batch)) == expected


# ---------------------------------------------------------------------------------------------
# End to end: a short last batch of each type leaves the stance before its step.


def _userdict(x: torch.Tensor, y: torch.Tensor) -> Any:
    return BatchEncoding(inputs=x, labels=y)


def _dataclass(x: torch.Tensor, y: torch.Tensor) -> Any:
    return Batch(x, y)


def _namedtuple(x: torch.Tensor, y: torch.Tensor) -> Any:
    return Pair(x, y)


def _nested(x: torch.Tensor, y: torch.Tensor) -> Any:
    return {"features": [x], "target": {"y": y}}


CONTAINERS: dict[str, tuple[Callable[..., Any], Callable[[Any], tuple[Any, Any]]]] = {
    "userdict": (_userdict, lambda b: (b["inputs"], b["labels"])),
    "dataclass": (_dataclass, lambda b: (b.x, b.y)),
    "namedtuple": (_namedtuple, lambda b: (b.x, b.y)),
    "nested_dict": (_nested, lambda b: (b["features"][0], b["target"]["y"])),
}


class ContainerModule(TinyModule):
    """TinyModule whose steps take the batch as one container type."""

    def __init__(self, unpack: Callable[[Any], tuple[Any, Any]]) -> None:
        super().__init__()
        self.unpack = unpack

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(self.unpack(batch), batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        super().validation_step(self.unpack(batch), batch_idx)


class ContainerData(L.LightningDataModule):
    """100 training samples in batches of 16, the last one short (4 rows).

    Validation has 7 full batches in epochs 0 and 1 and a short eighth (2 rows)
    from epoch 2 on (loaders are reloaded every epoch): an evaluation loop uses
    the stance only after a pass without a compile, so its short batch must come
    after that to be unseen under the stance.
    """

    def __init__(self, make: Callable[..., Any]) -> None:
        super().__init__()
        self.make = make
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(100, 8, generator=g)
        self.y = self.x[:, :1] * 0.5 + 0.1 * torch.randn(100, 1, generator=g)
        self.xv = torch.randn(114, 8, generator=g)
        self.yv = self.xv[:, :1] * 0.5

    def _collate(self, samples: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        return self.make(torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples]))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=16, collate_fn=self._collate)

    def val_dataloader(self) -> DataLoader:
        n = 112 if self.trainer.current_epoch < 2 else 114
        data = TensorDataset(self.xv[:n], self.yv[:n])
        return DataLoader(data, batch_size=16, collate_fn=self._collate)


def _fit(model: L.LightningModule, make: Callable[..., Any], callbacks: list[Any]) -> None:
    L.seed_everything(0, verbose=False)
    trainer = make_trainer(callbacks, reload_dataloaders_every_n_epochs=1)
    trainer.fit(model, datamodule=ContainerData(make))


@pytest.mark.parametrize("kind", sorted(CONTAINERS))
def test_short_last_batch_of_a_container_rearms_before_the_step(kind: str) -> None:
    make, unpack = CONTAINERS[kind]
    L.seed_everything(0, verbose=False)
    eager = ContainerModule(unpack)
    _fit(eager, make, [])
    L.seed_everything(0, verbose=False)
    guarded = ContainerModule(unpack)
    cb = guard()
    _fit(guarded, make, [cb])
    assert_same_run(eager, guarded)

    s = cb.summary()
    assert s["steady_steps"] > 0
    rearms = s["rearms"]
    assert not [r for r in rearms if "stance miss" in r["reason"]], rearms
    for loop, rows in (("train", 4), ("validate", 2)):  # the short batches: 100 % 16, 114 % 16
        unseen = [
            r for r in rearms if r.get("loop") == loop and "unseen batch signature" in r["reason"]
        ]
        assert unseen, (loop, rearms)
        assert any(f"({rows}, 8) float32 cpu" in r["reason"] for r in unseen), unseen
