"""Configuration: the daemons' settings, each declared once (daemons.py, by schema.py's `setting`),
read from defaults < a TOML file < flags (schema.load_config), and the values every command parses
(values.py: sizes, durations, addresses, authentication). Only cli.py and this package read argv,
files or the environment; bad configuration is a ConfigError naming the key, exit EX_CONFIG (78).
Must stay cheap to import (no torch); imports nothing of the project but wire.
"""

from __future__ import annotations

from dilocod.config.daemons import (
    APPLY_MODES,
    DEFAULT_ENTRY,
    DEFAULT_PORT,
    MERGES,
    LearnerConfig,
    SyncerConfig,
    learner_seed,
)
from dilocod.config.schema import (
    Parse,
    Setting,
    default_text,
    defaults,
    flag_of,
    help_text,
    load_config,
    missing,
    settings,
)
from dilocod.config.values import (
    EX_CONFIG,
    Address,
    ConfigError,
    format_size,
    parse_address,
    parse_duration,
    parse_int_list,
    parse_list,
    parse_size,
    require_authentication,
    tls_paths,
)

__all__ = [
    "APPLY_MODES",
    "DEFAULT_ENTRY",
    "DEFAULT_PORT",
    "EX_CONFIG",
    "MERGES",
    "Address",
    "ConfigError",
    "LearnerConfig",
    "Parse",
    "Setting",
    "SyncerConfig",
    "default_text",
    "defaults",
    "flag_of",
    "format_size",
    "help_text",
    "learner_seed",
    "load_config",
    "missing",
    "parse_address",
    "parse_duration",
    "parse_int_list",
    "parse_list",
    "parse_size",
    "require_authentication",
    "settings",
    "tls_paths",
]
