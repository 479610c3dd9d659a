"""Every flag of every training command is in its command's resume table: either it defines the run (a resume must repeat
it) or it may change on resume. The flags are read from each command's own parser, so a flag added later without a
decision fails here. In process, no training: a second or two."""
import importlib, sys
import pytest
from memlab.flags import ArgumentParser
from memlab.resume_tables import DEFINES, MAY_CHANGE

COMMANDS = {'memlab_train': ('memlab.train', 'TRAIN_RESUME'), 'memlab_neurocache': ('memlab.train_neurocache', 'NEUROCACHE_RESUME'),
            'memlab_relora': ('memlab.train_relora', 'RELORA_RESUME'), 'memlab_distill': ('memlab.train_distill', 'DISTILL_RESUME'),
            'memlab_mixer': ('memlab.train_mixer', 'MIXER_RESUME'), 'memlab_bpt': ('memlab.train_bpt', 'BPT_RESUME')}

class _Parsed(Exception): pass

def parser_flags(module) -> set:
    "The destinations of every flag the command's parser offers (its config-file flag included), read by stopping it at parse time."
    seen, parse = {}, ArgumentParser.parse_args
    def stop(self, *a, **kw): seen['parser'] = self; raise _Parsed()
    ArgumentParser.parse_args = stop
    old_argv = sys.argv
    try:
        sys.argv = ['prog']
        with pytest.raises(_Parsed): importlib.import_module(module).main.__wrapped__()
    finally: ArgumentParser.parse_args, sys.argv = parse, old_argv
    return {a.dest for a in seen['parser']._actions if a.dest != 'help'}

@pytest.mark.parametrize('command', list(COMMANDS))
def test_every_flag_is_classified(command):
    module, name = COMMANDS[command]
    table, flags = getattr(importlib.import_module(module), name), parser_flags(module)
    assert table.command == command
    unclassified = sorted(f for f in flags if table.kind(f) is None)
    assert not unclassified, f"{command}: decide whether these define the run or may change on resume: {unclassified}"
    stale = sorted(set(table.defines + table.may_change) - flags)
    assert not stale, f"{command}: the table names flags the command does not have: {stale}"
    assert set(table.budget) <= set(table.may_change)

def test_the_kinds_hold_what_the_issue_names():
    "The cases of issue 40: a distillation's temperature and logits loss, ReLoRA's restart cycle and merge frequency define the run."
    from memlab.train_distill import DISTILL_RESUME
    from memlab.train_relora import RELORA_RESUME
    for t, f in ((DISTILL_RESUME, 'temperature'), (DISTILL_RESUME, 'logits_loss_fn'), (RELORA_RESUME, 'cycle_length'),
                 (RELORA_RESUME, 'relora')):
        assert t.kind(f) == DEFINES, f
    for t, f in ((DISTILL_RESUME, 'max_steps'), (RELORA_RESUME, 'eval_every'), (RELORA_RESUME, 'save_dir')):
        assert t.kind(f) == MAY_CHANGE, f

# each command's component configs: their every field is a flag of the command (one field, one default, one help text)
COMPONENTS = {'memlab_neurocache': ('memlab.neurocache', 'NeurocacheConfig', ''), 'memlab_bpt': ('memlab.bpt', 'BPTConfig', 'llama.'),
              'memlab_mixer': ('memlab.mixer', 'MixerModelArgs', '')}

@pytest.mark.parametrize('command', list(COMPONENTS))
def test_every_component_field_is_a_flag(command):
    "A setting added to a component's config is a flag of its command at once, with that field's name (under the seed's group)."
    import dataclasses
    module, name, prefix = COMPONENTS[command]
    cls, flags = getattr(importlib.import_module(module), name), parser_flags(COMMANDS[command][0])
    missing = sorted(f.name for f in dataclasses.fields(cls) if f.init and f"{prefix}{f.name}" not in flags)
    assert not missing, f"{command}: {name} fields with no flag: {missing}"
