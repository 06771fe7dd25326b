"""Evaluating a trained run: translation, the paper's metrics, attention maps.

  translate.py       Translator (restore + vocabulary + beam search), beam_translate
  score.py           evaluate_split: a whole split once, in order; BLEU, chrF, perplexity
  bleu.py            sacreBLEU, the paper's tokenized BLEU, chrF
  attention_maps.py  heatmaps of every head for one sentence
  validation.py      training's periodic validation: loss, perplexity and BLEU
"""
