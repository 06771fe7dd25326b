"""The embedded default: Tatoeba English -> Spanish, sized for a 2-core laptop CPU.

    make train
    # or: python train.py --config configs/default.py --workdir workdirs/default
    #     python eval.py --workdir workdirs/default --split test

7.6M parameters (3+3 layers, d_model 256, d_ff 1024, 4 heads, a shared 8,000-token BPE
vocabulary), 1,000 steps of about 1,000 real target tokens. The corpus ships in data/
(CC-BY 2.0 FR, tatoeba.org; see data/README.md), so this runs with no network.

Expected result:

<!-- results:make_train_expected -->
sacreBLEU 28.38 (tokenized BLEU 28.81) on the 1,992-sentence test split, perplexity 9.62
there; 1,000 steps in 7m12s on a 2-core AMD EPYC CPU (2026-12-05, commit b826233-dirty;
docs/results/make_train.jsonl).
<!-- /results -->

`configs/default.py:draft` is the same model with one encoder and one decoder layer: a
draft for speculative decoding (docs/decoding.md). Train it on the target run's
vocabulary, so the two share token ids:

    python train.py --config configs/default.py:draft --workdir workdirs/spec_draft \
        --config.vocab_from=workdirs/spec_target

`configs/default.py:shallow_draft` is a cheaper draft: one decoder layer that reads the
target's own encoder output, so it has no encoder pass of its own ("deep encoder,
shallow decoder"). Training copies the target's encoder and embedding, keeps them frozen
and trains only the decoder layer; its vocabulary is the target's, and decoding scores
only the 1,024 target-side ids most frequent in training (transformer/model/draft.py):

    python train.py --config configs/default.py:shallow_draft --workdir workdirs/spec_shallow \
        --config.draft.target_workdir=workdirs/spec_target
"""

from transformer import config as config_lib


def get_config(arg=None):
  if arg not in (None, "", "draft", "shallow_draft"):
    raise ValueError(
      f"configs/default.py: argument {arg!r} must be empty, 'draft' or 'shallow_draft'"
    )
  c = config_lib.base_config()
  c.dataset = "tatoeba_en_es"
  c.direction = "en-es"
  c.vocab_size = 8000
  c.max_len = 64
  # Packing: Tatoeba sentences are short (about 10 subwords), so several pairs share a
  # row; no padding is computed and there is a single batch shape to compile.
  c.batching = "packed"
  c.tokens_per_batch = 1024
  c.eval_batch_size = 64

  c.model.num_layers = 3
  c.model.d_model = 256
  c.model.d_ff = 1024
  c.model.num_heads = 4
  c.model.d_k = 64
  c.model.d_v = 64
  # The run sees each pair less than once, so there is nothing to regularize against:
  # dropout would only slow learning. Label smoothing (0.1) stays, as in the paper.
  c.model.dropout_rate = 0.0

  # Small batches and a short warmup give the most learning per FLOP at this budget;
  # the schedule is the paper's, scaled by 0.5.
  c.num_train_steps = 1000
  c.warmup_steps = 300
  c.learning_rate_scale = 0.5
  c.log_every_steps = 50
  c.eval_every_steps = 500
  c.eval_bleu_sentences = 0  # the test split is beam-searched after training instead
  # Five kept, steps 600 to 1000: what README's `eval.py --average_last 5` averages.
  c.checkpoint_every_steps = 100
  c.checkpoint_every_minutes = 0.0
  c.keep_checkpoints = 5

  if arg == "draft":
    # One layer per stack (num_layers sets both) and nothing else changed: the target's
    # vocabulary size and widths, so it reads the target's vocabulary (vocab_from).
    c.model.num_layers = 1
  if arg == "shallow_draft":
    # config.model stays the target's (the draft reads its encoder); the draft's own
    # decoder has one layer. One layer learns fast: a shorter run, as warm as the target's.
    c.draft.num_layers = 1
    c.draft.shortlist_size = 1024
    c.num_train_steps = 400
    c.warmup_steps = 150
    c.eval_every_steps = 200
    c.checkpoint_every_steps = 200
  return c
