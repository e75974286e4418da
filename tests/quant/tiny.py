"""Tiny model configs the quantization tests share."""

from turbospark_jax.models.qwen3_5 import config as QC

#: A Qwen3.5 text model with two DeltaNet and two full-attention layers, sized so int4 groups
#: of 32 fit every matrix.
QWEN35 = QC.Qwen35Config(model_type="qwen3_5_text", vocab_size=64, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=16,
                         layer_types=(QC.LINEAR, QC.FULL, QC.LINEAR, QC.FULL))
