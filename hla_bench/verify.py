"""`hla-bench verify`: the HLA identity checks on random data.

Every form of every HLA mixer (hla2 masked and unmasked, ahla2, hla3 causal and paper), of
linear attention and of Based (Triton where the device has it) and the state paths (a run split through `initial_state`, a prefill
followed by decoder steps) are compared with the mixer's float64 reference (its operator's
naive.py: the explicit finite sums), computed on the CPU from the same dtype-rounded inputs.
A second table shows, as data, how far the paper's own formulas are from the corrected
operators (docs/discrepancies.md). Every operator is reached through the registry: its op, its
decoder and its reference.

Exit code 0 when every pair that should agree does, 1 otherwise; 2 for usage errors (no
CUDA device, a --yaml file that cannot be written or replaced: both found before the checks
run). --yaml follows bench's --out policy (`store.check_out`): an existing file is replaced
only with --overwrite and only when it is a verify output; never through a symbolic link.
A --seq-len whose references need more memory than is available is a usage error too.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from dataclasses import dataclass

import click
import torch
import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hla_bench import registry
from hla_bench.results.load import file_kind
from hla_bench.results.store import StoreError, atomic_write_text, check_out, check_writable
from hla_bench.results.tables import pack, print_table
from mixers.errors import relative_error

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
# Max relative error (max |o - ref| / max |ref|) allowed against the float64 reference.
TOLERANCES = {"float64": 1e-10, "float32": 1e-4, "bfloat16": 2e-2}
BATCH, HEADS, HEAD_DIM, VALUE_DIM = 2, 2, 16, 16  # 16: the smallest head dim the Triton kernels take
CHUNK_SIZE = 12          # does not divide the default length: the padded path is checked too
# Bytes per T^4 that the largest float64 reference holds at once: hla3's sums over (t, i, u, j)
# keep a T^4 table (as bool, then float64: 9 bytes) and contract it through einsum
# intermediates of up to two float64 [B, H, T, T, T, T] tensors (2 B H 8 bytes).
REFERENCE_BYTES_PER_T4 = 2 * BATCH * HEADS * 8 + 9


def reference_bytes(seq_len: int) -> int:
    """The memory the largest reference needs at `seq_len` (REFERENCE_BYTES_PER_T4)."""
    return REFERENCE_BYTES_PER_T4 * seq_len ** 4


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (what can be allocated without swapping), None where the
    system does not tell."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def seq_len_problem(seq_len: int, available: int | None) -> str | None:
    """Why `seq_len` cannot be checked here: the references' memory (reference_bytes) above
    `available` bytes; None when it fits or `available` is unknown."""
    if available is None or reference_bytes(seq_len) <= available:
        return None
    largest = int((available / REFERENCE_BYTES_PER_T4) ** 0.25)  # corrected for rounding:
    while reference_bytes(largest + 1) <= available:
        largest += 1
    while largest > 0 and reference_bytes(largest) > available:
        largest -= 1
    if largest < 2:
        return (f"{seq_len} needs about {reference_bytes(seq_len) / 2**30:.3g} GiB for the "
                f"float64 references, and only {available / 2**30:.3g} GiB of memory is "
                "available here: too little for any length")
    return (f"{seq_len} needs about {reference_bytes(seq_len) / 2**30:.3g} GiB for the float64 "
            f"references (explicit sums over T^4 index tuples), more than the "
            f"{available / 2**30:.3g} GiB of memory available here; give at most {largest}")


@dataclass
class Case:
    """One mixer with one option set: its forms are checked against its reference."""

    mixer: str
    option: str
    options: dict
    forms: tuple[str, ...]
    continuation: bool = True           # also check initial_state splits and decode steps
    shared_kv: bool = False             # k and v with one head (multi-query)


def cases(device: str) -> list[Case]:
    per_head = torch.tensor([0.95, 0.8], dtype=torch.float64)
    triton = ("triton",) if device == "cuda" else ()
    hla2_forms = forms2 = forms3 = ("serial", "scan", "chunk", "parallel") + triton
    return [
        Case("hla2", "masked", {}, hla2_forms),
        Case("hla2", "masked, normalize", {"normalize": True}, hla2_forms),
        Case("hla2", "masked, decay 0.9", {"decay": 0.9}, hla2_forms),
        Case("hla2", "masked, decay per head, normalize",
             {"decay": per_head, "normalize": True}, hla2_forms),
        Case("hla2", "masked, decay 0.9, paper form", {"decay": 0.9, "decay_form": "paper"},
             hla2_forms),
        Case("hla2", "masked, decay per head, paper form, normalize",
             {"decay": per_head, "decay_form": "paper", "normalize": True}, hla2_forms),
        Case("hla2-unmasked", "unmasked", {}, hla2_forms),
        Case("hla2-unmasked", "unmasked, decay 0.9, normalize",
             {"decay": 0.9, "normalize": True}, hla2_forms),
        Case("hla2", "masked, ridge 0.5", {"ridge": 0.5}, hla2_forms),
        Case("hla2", "masked, ridge 0.5, normalize", {"ridge": 0.5, "normalize": True},
             hla2_forms),
        Case("hla2", "masked, multi-query k/v", {}, hla2_forms, continuation=False,
             shared_kv=True),
        Case("linear-attn", "identity", {}, ("chunk", "parallel") + triton),
        Case("linear-attn", "elu1, normalize", {"feature_map": "elu1", "normalize": True},
             ("chunk", "parallel") + triton),
        Case("based", "taylor, normalize", {}, ("chunk", "parallel") + triton),
        Case("ahla2", "plain", {}, forms2),
        Case("ahla2", "normalize", {"normalize": True}, forms2),
        Case("ahla2", "decay 0.9", {"decay": 0.9}, forms2),
        Case("ahla2", "decay per head, normalize", {"decay": per_head, "normalize": True},
             forms2),
        Case("hla3", "causal", {"variant": "causal"}, forms3),
        Case("hla3", "causal, normalize", {"variant": "causal", "normalize": True}, forms3),
        Case("hla3", "paper", {"variant": "paper"}, ("serial", "scan")),
        Case("hla3", "paper, normalize", {"variant": "paper", "normalize": True},
             ("serial", "scan")),
    ]


def random_inputs(seed: int, seq_len: int, dtype: torch.dtype, shared_kv: bool = False):
    """q, k: positive features |N(0,1)|/sqrt(D) (so normalized denominators stay away from 0);
    v: N(0,1). Float64 on the CPU, rounded through `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads = 1 if shared_kv else HEADS
    q = torch.randn(BATCH, seq_len, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(BATCH, seq_len, kv_heads, HEAD_DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(BATCH, seq_len, kv_heads, VALUE_DIM, generator=gen, dtype=torch.float64)
    q, k = q.abs() / HEAD_DIM ** 0.5, k.abs() / HEAD_DIM ** 0.5
    return tuple(x.to(dtype).double() for x in (q, k, v))


def _on_device(options: dict, device: str) -> dict:
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value
            for key, value in options.items()}


def run_case(case: Case, *, seed: int, seq_len: int, dtype_name: str, device: str) -> list[dict]:
    """Rows (operator, option, pair, error, tolerance, status) for every check of `case`;
    the operator is the mixer's registry name."""
    dtype, tolerance = DTYPES[dtype_name], TOLERANCES[dtype_name]
    mixer = registry.get(case.mixer)
    q, k, v = random_inputs(seed, seq_len, dtype, case.shared_kv)
    reference = mixer.reference(**case.options)(q, k, v)
    qd, kd, vd = (x.to(device, dtype) for x in (q, k, v))
    options = _on_device(case.options, device)
    rows = []

    def check(pair, compute):
        row = {"operator": case.mixer, "option": case.option, "pair": pair,
               "error": None, "tolerance": tolerance}
        try:
            row["error"] = relative_error(compute(), reference)
            row["status"] = "pass" if row["error"] <= tolerance else "FAIL"
        except NotImplementedError as exc:
            row.update(status="error", note=f"not implemented: {exc}")
        except (ValueError, registry.MixerUnavailableError) as exc:
            # an option or a requirement a form does not offer (Triton) is not a failure
            row.update(status="skip" if pair.startswith("triton") else "error", note=str(exc))
        rows.append(row)

    for form in case.forms:
        check(f"{form} vs naive",
              lambda: mixer.op(impl=form, chunk_size=CHUNK_SIZE, **options)(qd, kd, vd)[0])
    if case.continuation:
        split = (2 * seq_len) // 3

        def prefill():
            """(op, output, state) of the op (impl "auto") on the first `split` tokens."""
            op = mixer.op(chunk_size=CHUNK_SIZE, **options)
            first, state = op(qd[:, :split], kd[:, :split], vd[:, :split],
                              output_final_state=True)
            return op, first, state

        def split_run():
            op, first, state = prefill()
            second, _ = op(qd[:, split:], kd[:, split:], vd[:, split:], initial_state=state)
            return torch.cat([first, second], dim=1)

        def prefill_then_steps():
            _, first, state = prefill()
            decoder = mixer.decoder(**options)
            outputs = [first]
            for t in range(split, seq_len):
                o_t, state = decoder.step(qd[:, t], kd[:, t], vd[:, t], state)
                outputs.append(o_t.unsqueeze(1))
            return torch.cat(outputs, dim=1)

        check("split via initial_state vs naive", split_run)
        check("prefill + step vs naive", prefill_then_steps)
    return rows


def discrepancies(*, seed: int, seq_len: int, dtype_name: str, device: str) -> list[dict]:
    """How far the paper's formulas are from the corrected operators (relative difference of
    the outputs; informative rows, not failures)."""
    dtype = DTYPES[dtype_name]
    q, k, v = (x.to(device, dtype) for x in random_inputs(seed, seq_len, dtype))
    rows = []

    def output(name, **options):
        return lambda: registry.get(name).op(**options)(q, k, v)[0]

    def add(what, setting, compute_paper, compute_corrected):
        row = {"comparison": what, "setting": setting, "relative_difference": None}
        try:
            row["relative_difference"] = relative_error(compute_paper(),
                                                        compute_corrected().double().cpu())
        except (NotImplementedError, ValueError) as exc:
            row["note"] = str(exc)
        rows.append(row)

    for g in (1.0, 0.9, 0.5):
        add("hla2 decay_form paper vs masked", f"decay {g}",
            output("hla2", decay=g, decay_form="paper"),
            output("hla2", decay=g, decay_form="masked"))
    for normalize in (False, True):
        add("hla3 variant paper vs causal", "normalize" if normalize else "plain",
            output("hla3", variant="paper", normalize=normalize),
            output("hla3", variant="causal", normalize=normalize))
    return rows


def run_all(*, seed: int, seq_len: int, dtype_name: str, device: str) -> dict:
    start = time.perf_counter()
    checks = [row for case in cases(device)
              for row in run_case(case, seed=seed, seq_len=seq_len, dtype_name=dtype_name,
                                  device=device)]
    return {"device": device, "dtype": dtype_name, "seed": seed, "seq_len": seq_len,
            "checks": checks,
            "discrepancies": discrepancies(seed=seed, seq_len=seq_len, dtype_name=dtype_name,
                                           device=device),
            "passed": all(row["status"] in ("pass", "skip") for row in checks),
            "wall_s": round(time.perf_counter() - start, 2)}


# The --yaml file: `kind: verify`, this schema version, then run_all's fields.
OUTPUT_SCHEMA = 1
# The first keys of run_all's result, which began --yaml files written before the kind line.
_LEGACY_KEYS = ["device", "dtype", "seed", "seq_len", "checks"]


def output_kind(path: Path) -> str | None:
    """The kind of the file at `path` as --yaml's policy sees it: the kind its first lines
    name (`load.file_kind`), "verify" for a verify output written before the kind line
    (a mapping starting with run_all's keys and holding `passed`), else None."""
    kind = file_kind(path)
    if kind is not None:
        return kind
    try:
        with open(path, "rb") as handle:
            data = yaml.safe_load(handle.read(2**24))
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return None
    if (isinstance(data, dict) and list(data)[:len(_LEGACY_KEYS)] == _LEGACY_KEYS
            and "passed" in data):
        return "verify"
    return None


STATUS_STYLE = {"pass": "[green]pass[/green]", "FAIL": "[bold red]FAIL[/bold red]",
                "error": "[bold red]error[/bold red]", "skip": "[yellow]skip[/yellow]"}


def checks_table(result: dict) -> Table:
    """The checks, a heading row per case (operator · options) and a row per form pair;
    the pair column is never narrower than its longest pair, and a heading breaks only
    between option phrases."""
    table = Table(title=f"HLA identities ({result['dtype']} on {result['device']}, "
                        f"T={result['seq_len']}, seed {result['seed']}; reference: float64 "
                        f"explicit sums on the CPU)")
    pairs = [f"  {row['pair']}" for row in result["checks"]]
    width = max(map(len, pairs), default=0)
    table.add_column("case · form pair", min_width=width)
    table.add_column("max rel. error", justify="right", no_wrap=True)
    table.add_column("tolerance", justify="right", no_wrap=True)
    table.add_column("result")
    case = None
    for row, pair in zip(result["checks"], pairs):
        if (row["operator"], row["option"]) != case:
            case = row["operator"], row["option"]
            heading = escape("\n".join(pack(_case_items(row), width, " ")))
            table.add_row(heading.replace(row["operator"], f"[bold]{row['operator']}[/bold]", 1),
                          "", "", "")
        error = "-" if row["error"] is None else f"{row['error']:.2e}"
        status = STATUS_STYLE[row["status"]] + (f" {escape(row['note'])}" if row.get("note") else "")
        table.add_row(pair, error, f"{row['tolerance']:.0e}", status)
    return table


def _case_items(row: dict) -> list[str]:
    """A case's heading as items that stay whole: the operator, then each option phrase
    (`decay per head`) with its comma."""
    phrases = row["option"].split(", ")
    return [f"{row['operator']} · {phrases[0]}" + ("," if len(phrases) > 1 else ""),
            *(phrase + "," for phrase in phrases[1:-1]), *phrases[1:][-1:]]


def checks_lines(result: dict) -> list[str | list[str]]:
    """The checks as plain lines, for a console too narrow for their table (a check's line
    as items, so that its form pair stays on one line)."""
    lines = [f"HLA identities ({result['dtype']} on {result['device']}, T={result['seq_len']}, "
             f"seed {result['seed']}; reference: float64 explicit sums on the CPU)"]
    case = None
    for row in result["checks"]:
        if (row["operator"], row["option"]) != case:
            case = row["operator"], row["option"]
            lines.append(_case_items(row))
        error = "-" if row["error"] is None else f"{row['error']:.2e}"
        lines.append([f"  {row['pair']}:", error, f"(tolerance {row['tolerance']:.0e})",
                      row["status"], *(row.get("note") or "").split()])
    return lines


def discrepancies_table(result: dict) -> Table:
    notes = Table(title="Paper formulas vs corrected operators (data, not failures)")
    notes.add_column("comparison", no_wrap=True)
    notes.add_column("setting", no_wrap=True)
    notes.add_column("relative difference", justify="right")
    for row in result["discrepancies"]:
        notes.add_row(row["comparison"], row["setting"], _difference(row))
    return notes


def _difference(row: dict) -> str:
    value = row["relative_difference"]
    return f"{value:.3g}" if value is not None else f"- ({row.get('note')})"


def render(result: dict, console: Console) -> None:
    print_table(console, checks_table(result), lambda: checks_lines(result))
    print_table(console, discrepancies_table(result), lambda: [
        "Paper formulas vs corrected operators (data, not failures)",
        *([f"  {row['comparison']},", f"{row['setting']}:", *_difference(row).split()]
          for row in result["discrepancies"])])
    failed = sum(row["status"] in ("FAIL", "error") for row in result["checks"])
    console.print(f"{len(result['checks']) - failed}/{len(result['checks'])} checks agree "
                  f"in {result['wall_s']} s" + ("" if result["passed"] else
                                                f"; [bold red]{failed} failed[/bold red]"))


@click.command()
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--dtype", "dtype_name", type=click.Choice(list(DTYPES)), default="float64",
              show_default=True, help="Input dtype of the checked forms.")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True)
@click.option("--seq-len", type=click.IntRange(min=2), default=32, show_default=True,
              help="Tokens per check (the references are O(T^3) to O(T^4) sums; a length "
                   "whose references need more memory than is available is refused).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.option("--yaml", "yaml_path", type=click.Path(dir_okay=False),
              help="Also write the results to this YAML file (a new one; see --overwrite).")
@click.option("--overwrite", is_flag=True,
              help="Replace an existing --yaml file that is a verify output (nothing else).")
def verify(device: str, dtype_name: str, seed: int, seq_len: int, as_json: bool,
           yaml_path: str | None, overwrite: bool) -> None:
    """Check every HLA form against the explicit float64 sums; exit 1 on any disagreement."""
    if device == "cuda" and not torch.cuda.is_available():
        raise click.BadParameter("no CUDA device here", param_hint="--device")
    problem = seq_len_problem(seq_len, available_memory_bytes())
    if problem:
        raise click.BadParameter(problem, param_hint="--seq-len")
    if yaml_path is not None and not yaml_path.strip():
        raise click.BadParameter("is empty: give a file", param_hint="--yaml")
    if yaml_path:
        try:  # bench's --out policy, before the checks run, not after
            check_out(yaml_path, "verify", "overwrite" if overwrite else "new", output_kind)
            check_writable(yaml_path)
        except StoreError as error:
            raise click.BadParameter(str(error), param_hint="--yaml") from None
    try:
        result = run_all(seed=seed, seq_len=seq_len, dtype_name=dtype_name, device=device)
    except (MemoryError, RuntimeError) as error:
        from hla_bench.speed.runner import is_oom

        if not is_oom(error):
            raise
        raise click.ClickException(
            f"out of memory at --seq-len {seq_len} (the float64 references are explicit sums "
            f"over T^4 index tuples): give a smaller --seq-len; {error}"[:1000]) from None
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        render(result, Console())
    if yaml_path:
        try:
            atomic_write_text(yaml_path, yaml.safe_dump(
                {"kind": "verify", "schema_version": OUTPUT_SCHEMA, **result}, sort_keys=False))
        except OSError as error:
            raise click.ClickException(f"cannot write {yaml_path}: {error}") from None
    raise SystemExit(0 if result["passed"] else 1)


commands = [verify]
