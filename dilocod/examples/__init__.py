"""Examples of dilocod entries that ship with it.

charlm: a small byte-level GPT trained on the Python standard library's sources, the embedded
default model of `dilocod learner`, `dilocod syncer` and `dilocod demo` (entry
"dilocod.examples.charlm:make_trainer"). Importing this package imports nothing heavy; importing
charlm imports torch.
"""
