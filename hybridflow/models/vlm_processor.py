"""`TinyVLProcessor`: Qwen2-VL's processor without a video processor, registered with ``AutoProcessor``.

Why a subclass: transformers' ``Qwen2VLProcessor`` requires a video processor, and every video processor
requires torchvision, which is not installed here (its PyPI wheels are built for a CUDA torch). Images
take exactly Qwen2-VL's path (``replace_image_token``: one ``<|image_pad|>`` per merged patch), so
``input_ids`` / ``pixel_values`` / ``image_grid_thw`` / ``mm_token_type_ids`` are the stock processor's.
Importing this module registers the class (under a private config type, so no HF model's mapping changes);
``processor_config.json`` names it, and ``AutoProcessor.from_pretrained(dir)`` then finds it by name.
"""

from __future__ import annotations

from transformers import AutoProcessor, PretrainedConfig
from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin


class TinyVLProcessor(Qwen2VLProcessor):
    """Image processor + tokenizer (the attributes come from this ``__init__``'s signature: no video)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


class _TinyVLProcessorKey(PretrainedConfig):
    """Only a registry key for `TinyVLProcessor` (AutoProcessor.register takes a config class)."""

    model_type = "hybridflow_tiny_vl_processor"


AutoProcessor.register(_TinyVLProcessorKey, TinyVLProcessor, exist_ok=True)
