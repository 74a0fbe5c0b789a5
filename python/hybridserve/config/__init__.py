"""Engine configuration: the flags and `EngineArgs` (args.py), the speculative config
(speculative.py), what the policy knows about a model (capabilities.py), the resolved
configuration and its explanation (explain.py), cache sizing (sizing.py), the plan of one engine
(plan.py: the resolved configuration with its cache sizes), and the CLI (cli.py). The policy
itself is Rust (`_core.resolve_policy`); importing this package does not import torch (making a
plan does: it parses the model's config with its architecture).
"""

from hybridserve.config.args import DEFAULT_MAX_QUEUE_LEN, DTYPES, EngineArgs, parse_bytes
from hybridserve.config.capabilities import ModelCapabilities, read_model_capabilities, resolve_model_dir
from hybridserve.config.cli import add_config_args, add_engine_args, config_main
from hybridserve.config.explain import Decision, ResolvedEngineConfig, format_resolved, log_decisions
from hybridserve.config.speculative import (
    DEFAULT_PROMPT_LOOKUP_MAX,
    DEFAULT_PROMPT_LOOKUP_MIN,
    MAX_PROMPT_LOOKUP,
    SpeculativeConfig,
)

__all__ = [
    "DEFAULT_MAX_QUEUE_LEN",
    "DEFAULT_PROMPT_LOOKUP_MAX",
    "DEFAULT_PROMPT_LOOKUP_MIN",
    "DTYPES",
    "MAX_PROMPT_LOOKUP",
    "Decision",
    "EngineArgs",
    "ModelCapabilities",
    "ResolvedEngineConfig",
    "SpeculativeConfig",
    "add_config_args",
    "add_engine_args",
    "config_main",
    "format_resolved",
    "log_decisions",
    "parse_bytes",
    "read_model_capabilities",
    "resolve_model_dir",
]
