"""`train.py --resume`: the config run against the one the checkpoint records. A key whose change
alters what is trained or in what order (config.RESUME_EFFECTS' TRAINS) refuses the run in one line
naming each such key with both values, unless allowed (`--allow-change KEY`); the others pass, noted.
The changes a run makes are its history, with the global step from which each holds: in every
checkpoint's metadata (so a later resume compares against the config in effect last, and keeps the
history) and in config.yaml (config.CHANGES_KEY)."""

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..config import (
    CHANGES_KEY,
    DATA,
    RESUME_EFFECTS,
    RUNS,
    TRAINS,
    Config,
    config_to_dict,
    flat_config,
    load_config,
    nested_key,
    set_later_keys,
    unknown_key,
)
from ..data import data_path
from ..errors import UsageError
from ..weights.checkpoint import saved_config


def allowed_changes(values) -> set:
    """--allow-change's KEYs (the flag repeated, or comma-separated); a key that is none of the
    config's is a UsageError naming it (and the nearest one)."""
    keys = {key.strip() for value in values for key in value.split(",") if key.strip()}
    for key in sorted(keys):
        if key not in RESUME_EFFECTS:
            raise UsageError(f"--allow-change {unknown_key(key, RESUME_EFFECTS, '')}")
    return keys


@dataclass
class ResumedConfig:
    """What a checkpoint records: the config in effect at its last step, and the changes that led
    there ([{from_global_step: N, section.key: [old, new], ...}, ...], oldest first)."""

    checkpoint: Path
    recorded: Config
    history: list

    @classmethod
    def read(cls, checkpoint) -> "ResumedConfig | None":
        """From the checkpoint's header; None where it records no config."""
        config, history = saved_config(checkpoint)
        if config is None:
            return None
        recorded = load_config(None, base=config, base_source=f"{checkpoint}'s config")  # keys added since: defaults
        return cls(Path(checkpoint), recorded, history)

    def changes(self, cfg: Config) -> dict:
        """{section.key: (recorded, cfg's)} of each value that differs; an `auto` still to be set
        (`set_later_keys`: the memory plan's, once the trainer is built) is compared once set."""
        recorded, later = flat_config(self.recorded), set_later_keys()
        return {
            k: (recorded[k], v)
            for k, v in flat_config(cfg).items()
            if v != recorded[k] and not (v == "auto" and k in later)
        }

    def effect(self, key: str, cfg: Config) -> str:
        """TRAINS or RUNS: a DATA key's change is RUNS where the data set's place resolves to the
        same one (relative paths from the current directory: a run relaunched where it started)."""
        if RESUME_EFFECTS[key] != DATA:
            return RESUME_EFFECTS[key]
        same = Path(data_path(self.recorded.data)).resolve() == Path(data_path(cfg.data)).resolve()
        return RUNS if same else TRAINS

    def check(self, cfg: Config, allowed: set):
        """Before anything is built: a UsageError naming each change of what is trained that is
        not `allowed`, with both values, or each allowed key that did not change (unless this run's
        history changed it to that value: the same command, relaunched)."""
        changes = self.changes(cfg)
        refused = [key for key in changes if self.effect(key, cfg) == TRAINS and key not in allowed]
        if refused:
            listed = ", ".join(f"{key} {shown(changes[key][0])} -> {shown(changes[key][1])}" for key in refused)
            raise UsageError(
                f"--resume: the config differs from {self.checkpoint}'s in what is trained: {listed}; resume "
                f"with the checkpoint's values, or change them from here on with --allow-change {','.join(refused)}"
            )
        recorded, current = flat_config(self.recorded), flat_config(cfg)
        made = {(key, json.dumps(pair[1])) for entry in self.history for key, pair in entry.items() if key in current}
        unchanged = sorted(key for key in allowed - set(changes) if (key, json.dumps(current[key])) not in made)
        if unchanged:
            values = ", ".join(f"{key} {shown(recorded[key])}" for key in unchanged)
            raise UsageError(
                f"--allow-change {','.join(unchanged)}: as in {self.checkpoint} ({values}): nothing to allow"
            )

    def record(self, cfg: Config, from_global_step: int) -> tuple[list, str | None]:
        """-> (the history with this run's changes, once `auto` is set, from `from_global_step` on;
        a one-line note of them, or None where nothing changed)."""
        changes = self.changes(cfg)
        if not changes:
            return self.history, None
        entry = {"from_global_step": from_global_step, **{key: list(pair) for key, pair in changes.items()}}
        untrained = {key for key in changes if self.effect(key, cfg) == RUNS}
        listed = ", ".join(
            f"{key} {shown(old)} -> {shown(new)}" + (" (not what is trained)" if key in untrained else "")
            for key, (old, new) in changes.items()
        )
        return [*self.history, entry], f"--resume: the config changes from global step {from_global_step} on: {listed}"


def config_text(cfg: Config, history: list) -> str:
    """config.yaml's text: `cfg`; where `history` holds changes, the config the run started with
    (`cfg` with each change undone), then `changes:` (`load_config` reads the file as `cfg`)."""
    started = config_to_dict(cfg)
    for change in reversed(history):
        for key, pair in change.items():
            if key != "from_global_step":
                nested_key(key, pair[0], started)
    text = yaml.safe_dump(started, sort_keys=False)
    if history:
        text += "# what resumes changed: each key's [old, new] value, the new from_global_step on\n"
        text += yaml.safe_dump({CHANGES_KEY: history}, sort_keys=False, default_flow_style=None)
    return text


def shown(value) -> str:
    """A config value as a message shows it: JSON's spelling ("" for an empty path, true, [64])."""
    return json.dumps(value)
