"""The embedded default: Tatoeba English -> Spanish, sized for a 2-core laptop CPU.

    make train
    # or: python train.py --config configs/default.py --workdir workdirs/default

The corpus ships in data/ (CC-BY 2.0 FR, tatoeba.org; see data/README.md), so this runs
with no network. README records the wall time, throughput and BLEU it reaches.
"""

from transformer import config as config_lib


def get_config():
  c = config_lib.base_config()
  c.dataset = "tatoeba_en_es"
  c.direction = "en-es"
  c.vocab_size = 8000
  c.max_len = 64
  c.tokens_per_batch = 4096

  c.model.num_layers = 3
  c.model.d_model = 256
  c.model.d_ff = 1024
  c.model.num_heads = 4
  c.model.d_k = 64
  c.model.d_v = 64
  c.model.dropout_rate = 0.1

  c.num_train_steps = 6000
  c.warmup_steps = 1000
  c.learning_rate_scale = 1.0
  c.log_every_steps = 50
  c.eval_every_steps = 1000
  c.checkpoint_every_steps = 1000
  c.checkpoint_every_minutes = 5.0
  c.keep_checkpoints = 5
  return c
