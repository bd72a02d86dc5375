"""Model families and the named models of the zoo.

A model description is a dict of sizes (a zoo YAML, a user's YAML file, or a Python dict)
whose `family` picks the graph builder. `load_model` accepts any of the three.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

import sympy

from model_zoo.described import DescribedConfig, build_described
from model_zoo.dlrm import DLRMConfig, TableGroup, build_dlrm
from model_zoo.transformer import TransformerConfig, build_transformer
from stg.errors import ModelSpecError
from stg.graph import DType, Graph
from stg.yamlio import read_yaml


@dataclass(frozen=True)
class GraphOptions:
    """What a plan decides about the forward graph itself."""

    flash_attention: bool = True  # attention scores stay on chip
    table_groups: tuple[TableGroup, ...] | None = None  # embedding tables as the plan groups them
    fp8: bool = False  # linear layers' GEMMs in fp8 (Transformer Engine's recipe)
    fp8_params: bool = False  # and their weights stored in fp8 (no 16-bit copy)
    kv_cache: str | None = None  # an inference step over a KV cache of this dtype (stg/serve)


def _transformer(config, options: GraphOptions) -> Graph:
    kv_cache = DType.parse(options.kv_cache) if options.kv_cache else None
    return build_transformer(config, options.flash_attention, options.fp8, options.fp8_params, kv_cache)


# family -> (config parser, graph builder)
FAMILIES = {
    "gpt": (TransformerConfig.from_dict, _transformer),
    "llama": (TransformerConfig.from_dict, _transformer),
    "mixtral": (TransformerConfig.from_dict, _transformer),
    "deepseek": (TransformerConfig.from_dict, _transformer),
    "graph": (DescribedConfig.from_dict, lambda config, options: build_described(config, options.flash_attention)),
    "dlrm": (DLRMConfig.from_dict, lambda config, options: build_dlrm(config, options.table_groups)),  # recommendation
}


@dataclass(frozen=True)
class Model:
    """A parsed model description: its config, the values of its symbols, its forward graph."""

    config: Any
    source: str

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def family(self) -> str:
        return self.config.family

    @property
    def layers(self) -> int:
        return self.config.layers

    @property
    def sizes(self) -> Mapping[sympy.Symbol, int]:
        return self.config.sizes()

    @cached_property
    def graph(self) -> Graph:
        """Forward graph of one micro-batch, sizes symbolic (fused attention, unsharded tables)."""
        return self.forward_graph(GraphOptions())

    def forward_graph(self, options: GraphOptions = GraphOptions()) -> Graph:
        """Forward graph of one micro-batch; without flash attention the attention scores
        and probabilities are materialised (and saved for the backward)."""
        if options == GraphOptions() and "graph" in self.__dict__:
            return self.__dict__["graph"]
        if options.kv_cache and FAMILIES[self.family][1] is not _transformer:
            raise ModelSpecError(f"model {self.name!r}: serving needs a transformer family "
                                 f"(gpt, llama, mixtral, deepseek), not {self.family}")
        try:
            return _forward_graph(self.config, options)
        except TypeError:  # an unhashable config (lists inside): build without the cache
            return _forward_graph.__wrapped__(self.config, options)

    @cached_property
    def params(self) -> int:
        return int(self.graph.parameter_count().xreplace(dict(self.sizes)))

    def describe(self) -> dict:
        return {"name": self.name, "family": self.family, "layers": self.layers, "params": self.params}


@functools.lru_cache(maxsize=8)
def _forward_graph(config, options: GraphOptions) -> Graph:
    """Built once per model and options in a process: the summary's parameter count, the
    stage balancer and the symbolic passes all read the same graph (graphs are not mutated)."""
    graph = FAMILIES[config.family][1](config, options)
    graph.verify()
    return graph


def zoo_names() -> list[str]:
    folder = resources.files("model_zoo") / "models"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_model(spec: str | Path | Mapping) -> Model:
    """A zoo name (`llama3-70b`), a path to a model YAML, a HuggingFace config.json (or a folder
    holding one), or a dict of the YAML's fields."""
    if isinstance(spec, Mapping):
        return _from_dict(dict(spec), source="<dict>")
    text = str(spec)
    path = Path(text)
    if text.endswith(".json") or (path.is_dir() and (path / "config.json").is_file()):
        from model_zoo.hf import from_hf_config

        return _from_dict(from_hf_config(path), source=str(path))
    if text.endswith((".yaml", ".yml")) or path.is_file():
        if not path.is_file():
            raise ModelSpecError(f"model file {text} does not exist")
        return _from_dict(_read_yaml(path), source=str(path))
    if text in zoo_names():
        zoo_file = resources.files("model_zoo") / "models" / f"{text}.yaml"
        return _from_dict(_read_yaml(zoo_file), source=f"zoo:{text}")
    raise ModelSpecError(f"unknown model {text!r}: not a file and not in the zoo ({', '.join(zoo_names())})")


def _read_yaml(path) -> dict:
    data = read_yaml(path, f"model file {path}", ModelSpecError)
    if not isinstance(data, dict):
        raise ModelSpecError(f"model file {path}: expected a mapping of fields, got {type(data).__name__}")
    return data


def _from_dict(spec: dict, source: str) -> Model:
    family = spec.get("family")
    if not isinstance(family, str) or family not in FAMILIES:
        raise ModelSpecError(
            f"model {spec.get('name')!r}: family must be one of {sorted(FAMILIES)}, got {family!r}"
        )
    return Model(FAMILIES[family][0](spec), source)
