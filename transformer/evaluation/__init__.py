"""Using a trained run: scoring (eval.py), generation for people (generate.py), metrics.

translate.py       Generator (parameters + vocabulary + a search, one batch loop for
                   translating, continuing text and scoring), Translator (a trained
                   run's Generator, restored through transformer.inference), SearchSettings,
                   run_search (one batch through any search)
score.py           evaluate_split / evaluate_files: every sentence once, in order;
                   BLEU, chrF, perplexity
bleu.py            sacreBLEU, the paper's tokenized BLEU, chrF
attention_maps.py  heatmaps of every head for one sentence
validation.py      training's periodic validation: loss, perplexity and BLEU
"""
