"""SigLIP and SigLIP 2: the text and vision towers and the dual model, against `transformers`."""

import pytest

from port._errors import ConfigError
from port._transforms import Reshape


def test_a_dual_models_mapping_names_its_towers_sizes_by_dotted_keys():
    """A SiglipModel's config.json keeps its towers' sizes in `text_config` / `vision_config`."""
    config = {"text_config": {"num_attention_heads": 4, "hidden_size": 32}, "vision_config": 7}
    reshape = Reshape(("text_config.num_attention_heads", -1, "text_config.hidden_size")).resolve(config)
    assert reshape.target == (4, -1, 32)
    for missing in ("vision_config.hidden_size", "text_config.vocab_size", "text_config"):
        with pytest.raises(ConfigError, match=f"config.json has no integer '{missing}'"):
            Reshape((missing, -1)).resolve(config)
