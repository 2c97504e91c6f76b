"""Link benchmarks behind `dilocod bench` (its commands: commands.py): the raw TCP ceiling and
dilocod fragment transfers between two real processes. Imports torch only to make realistic
gradient bytes."""
