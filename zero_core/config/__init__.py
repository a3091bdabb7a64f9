"""DeepSpeed-compatible training configuration, validated once into frozen dataclasses. The
package owns the key tables and the reference of every supported key (:mod:`.keys`), the
typed result (:mod:`.schema`), the value and key checks (:mod:`.checks`) and
``parse_config`` with its section parsers (:mod:`.parser`).
"""
from zero_core.config.keys import NEUTRAL_VALUES, NOT_YET_IMPLEMENTED, SUPPORTED_KEYS
from zero_core.config.parser import parse_activation_checkpointing, parse_config, read_config
from zero_core.config.schema import ActivationCheckpointingConfig, Config, FP16Config

__all__ = [
    "Config", "FP16Config", "ActivationCheckpointingConfig", "parse_config",
    "parse_activation_checkpointing", "read_config", "SUPPORTED_KEYS", "NOT_YET_IMPLEMENTED", "NEUTRAL_VALUES",
]
