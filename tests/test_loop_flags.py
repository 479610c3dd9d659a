"Each command maps its seed's flags onto the loop's settings in one table, read by `train_config_from`: the tables are checked here, before any run."
import dataclasses
import pytest
from memlab.train_config import TrainConfig

def fields(cls) -> set: return {f.name for f in dataclasses.fields(cls)}

def tables():
    from memlab.train_relora import RELORA_LOOP_FLAGS, ReLoRARunConfig
    from memlab.train_neurocache import NEUROCACHE_LOOP_FLAGS, NeurocacheRunConfig
    from memlab.train_bpt import BPT_LOOP_FLAGS, FLAG_GROUPS
    from memlab.distill.arguments import DISTILL_LOOP_FLAGS, DistillationTrainingArguments
    return {'relora': (RELORA_LOOP_FLAGS, {'': ReLoRARunConfig}), 'neurocache': (NEUROCACHE_LOOP_FLAGS, {'': NeurocacheRunConfig}),
            'bpt': (BPT_LOOP_FLAGS, FLAG_GROUPS), 'distill': (DISTILL_LOOP_FLAGS, {'': DistillationTrainingArguments})}

@pytest.mark.parametrize('command', ['relora', 'neurocache', 'bpt', 'distill'])
def test_a_loop_table_names_loop_settings_and_real_flags(command):
    names, groups = tables()[command]
    assert set(names) <= fields(TrainConfig), set(names) - fields(TrainConfig)
    for field, flag in names.items():
        prefix, _, name = flag.rpartition('.')
        assert prefix in groups and name in fields(groups[prefix]), f"{command}: --{flag} (for {field}) is not a flag"

def test_no_command_builds_the_loop_config_field_by_field():
    """The mapping is written once: the command lines hand their tables to `train_config_from`; none writes a literal
    TrainConfig (a run with fixed settings and no flags, `train_fact_recall`, is no command: `memlab.experiment_runs`)."""
    import ast
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]/'memlab'
    built = []
    for p in [*root.glob('train_*.py'), root/'distill'/'arguments.py']:
        if p.name == 'train_config.py': continue
        for fn in ast.walk(ast.parse(p.read_text())):
            if isinstance(fn, ast.FunctionDef) and any(isinstance(n, ast.Call) and getattr(n.func, 'id', None) == 'TrainConfig'
                                                       for n in ast.walk(fn)):
                built.append(f"{p.name}:{fn.name}")
    assert not built, built
