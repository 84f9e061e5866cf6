"""The recipe's sections, one module each, named after its key: `model`, `data` (sources, packing), `eval`,
`training` (full | lora, the objective and its preference knobs, context parallelism), `lora`, `tracking`,
`output`, `compute` (the launchers' keys: AI Runtime's, `compute.slurm`). Every section is a `Section`
(`base.py`). A section holds its keys and the rules among them; the rules between sections, loading and dumping
are `ftcli.config.recipe`'s, which is also where every other module imports the schema from."""
