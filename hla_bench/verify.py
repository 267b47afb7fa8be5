"""`hla-bench verify`: the HLA identity checks on random data.

Every form of every HLA operator (hla2, ahla2, hla3 causal and paper; Triton where the device
has it) and the state paths (a run split through `initial_state`, a prefill followed by
`*_step` decode steps) are compared with the operator's explicit finite sum, computed in
float64 on the CPU from the same dtype-rounded inputs. A second table shows, as data, how far
the paper's own formulas are from the corrected operators (spec §1.1 and §3).

Exit code 0 when every pair that should agree does, 1 otherwise; 2 for usage errors (no
CUDA device, a --yaml file that cannot be written: both found before the checks run).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import click
import torch
import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hla_bench.store import StoreError, atomic_write_text, check_writable
from hla_bench.tables import pack, print_table
from mixers.hla import ahla2, ahla2_step, hla2, hla2_step, hla3, hla3_step
from mixers.hla.ahla2 import ahla2_naive
from mixers.hla.hla3 import hla3_naive

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
# Max relative error (max |o - ref| / max |ref|) allowed against the float64 explicit sum.
TOLERANCES = {"float64": 1e-10, "float32": 1e-4, "bfloat16": 2e-2}
BATCH, HEADS, HEAD_DIM, VALUE_DIM = 2, 2, 16, 16  # 16: the smallest head dim the Triton kernels take
CHUNK_SIZE = 12          # does not divide the default length: the padded path is checked too


def hla2_reference(q, k, v, *, masked=True, normalize=False, eps=1e-6, ridge=0.0, decay=None,
                   decay_form="masked"):
    """Second-order HLA as its explicit float64 sum (spec §1), weight on each (t, j, i):

    masked: g^((t-i)+(t-j)) (q_t.k_i)(q_j.k_i) on i <= j <= t; unmasked: the same on
    i, j <= t; decay_form "paper": the unmasked sum minus g^(t-1-j) (q_t.k_i)(q_j.k_i) on
    j < i <= t. ridge adds ridge (q_t.q_j) on j <= t (without decay only).
    """
    q, k, v = (x.double() for x in (q, k, v))
    H, T = q.shape[2], q.shape[1]
    k, v = k.expand(-1, -1, H, -1), v.expand(-1, -1, H, -1)       # multi-query: shared k, v
    g = torch.ones(H, dtype=torch.float64) if decay is None else \
        torch.as_tensor(decay, dtype=torch.float64).expand(H)
    pos = torch.arange(T)
    t, j, i = pos.view(-1, 1, 1), pos.view(1, -1, 1), pos.view(1, 1, -1)
    lag = lambda x: g.view(H, 1, 1, 1) ** x.clamp(min=0).double()
    inside = ((i <= t) & (j <= t)).double()
    if masked and (decay is None or decay_form == "masked"):
        weight = lag(t - i) * lag(t - j) * (inside * (i <= j))
    elif masked:
        weight = lag(t - i) * lag(t - j) * inside - lag(t - 1 - j) * (inside * (j < i))
    else:
        weight = lag(t - i) * lag(t - j) * inside
    qk = torch.einsum("bthd,bshd->bhts", q, k)
    w = torch.einsum("htji,bhti,bhji->bhtj", weight, qk, qk)
    if ridge:
        if decay is not None:
            raise ValueError("the ridge reference is written for decay=None only")
        w = w + ridge * torch.tril(torch.einsum("bthd,bshd->bhts", q, q))
    o = torch.einsum("bhtj,bjhe->bthe", w, v)
    if normalize:
        o = o / (w.sum(-1).transpose(1, 2).unsqueeze(-1) + eps)
    return o


@dataclass
class Case:
    """One operator with one option set: its forms are checked against `reference`."""

    operator: str
    option: str
    options: dict
    forms: tuple[str, ...]
    continuation: bool = True           # also check initial_state splits and decode steps
    shared_kv: bool = False             # k and v with one head (multi-query)
    extra: dict = field(default_factory=dict)   # options for the op only (not the reference)


OPERATORS = {"hla2": (lambda: hla2, lambda: hla2_step, hla2_reference),
             "ahla2": (lambda: ahla2, lambda: ahla2_step, ahla2_naive),
             "hla3": (lambda: hla3, lambda: hla3_step, hla3_naive)}


def cases(device: str) -> list[Case]:
    per_head = torch.tensor([0.95, 0.8], dtype=torch.float64)
    hla2_forms = ("serial", "scan", "chunk") + (("triton",) if device == "cuda" else ())
    forms2, forms3 = ("serial", "scan", "chunk"), ("serial", "scan", "chunk")
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
        Case("hla2", "unmasked", {"masked": False}, hla2_forms),
        Case("hla2", "unmasked, decay 0.9, normalize",
             {"masked": False, "decay": 0.9, "normalize": True}, hla2_forms),
        Case("hla2", "masked, ridge 0.5", {"ridge": 0.5}, hla2_forms),
        Case("hla2", "masked, ridge 0.5, normalize", {"ridge": 0.5, "normalize": True},
             hla2_forms),
        Case("hla2", "masked, multi-query k/v", {}, hla2_forms, continuation=False,
             shared_kv=True),
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


def relative_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    output = output.detach().to("cpu", torch.float64)
    return ((output - reference).abs().max() / reference.abs().max()).item()


def _on_device(options: dict, device: str) -> dict:
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value
            for key, value in options.items()}


def run_case(case: Case, *, seed: int, seq_len: int, dtype_name: str, device: str) -> list[dict]:
    """Rows (operator, option, pair, error, tolerance, status) for every check of `case`."""
    dtype, tolerance = DTYPES[dtype_name], TOLERANCES[dtype_name]
    op_of, step_of, reference_fn = OPERATORS[case.operator]
    op, step = op_of(), step_of()
    q, k, v = random_inputs(seed, seq_len, dtype, case.shared_kv)
    reference = reference_fn(q, k, v, **case.options)
    qd, kd, vd = (x.to(device, dtype) for x in (q, k, v))
    options = _on_device(case.options, device)
    rows = []

    def check(pair, compute):
        row = {"operator": case.operator, "option": case.option, "pair": pair,
               "error": None, "tolerance": tolerance}
        try:
            row["error"] = relative_error(compute(), reference)
            row["status"] = "pass" if row["error"] <= tolerance else "FAIL"
        except NotImplementedError as exc:
            row.update(status="error", note=f"not implemented: {exc}")
        except ValueError as exc:    # an option a form does not offer (Triton) is not a failure
            row.update(status="skip" if pair.startswith("triton") else "error", note=str(exc))
        rows.append(row)

    for form in case.forms:
        check(f"{form} vs naive",
              lambda: op(qd, kd, vd, impl=form, chunk_size=CHUNK_SIZE, **options)[0])
    if case.continuation:
        split = (2 * seq_len) // 3

        def split_run():
            first, state = op(qd[:, :split], kd[:, :split], vd[:, :split], chunk_size=CHUNK_SIZE,
                              output_final_state=True, **options)
            second, _ = op(qd[:, split:], kd[:, split:], vd[:, split:], chunk_size=CHUNK_SIZE,
                           initial_state=state, **options)
            return torch.cat([first, second], dim=1)

        def prefill_then_steps():
            first, state = op(qd[:, :split], kd[:, :split], vd[:, :split], chunk_size=CHUNK_SIZE,
                              output_final_state=True, **options)
            outputs = [first]
            for t in range(split, seq_len):
                o_t, state = step(qd[:, t], kd[:, t], vd[:, t], state, **options)
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
            lambda: hla2(q, k, v, decay=g, decay_form="paper")[0],
            lambda: hla2(q, k, v, decay=g, decay_form="masked")[0])
    for normalize in (False, True):
        add("hla3 variant paper vs causal", "normalize" if normalize else "plain",
            lambda: hla3(q, k, v, variant="paper", normalize=normalize)[0],
            lambda: hla3(q, k, v, variant="causal", normalize=normalize)[0])
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
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--seq-len", type=click.IntRange(min=2), default=32, show_default=True,
              help="Tokens per check (the references are O(T^3) to O(T^4) sums).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.option("--yaml", "yaml_path", type=click.Path(dir_okay=False),
              help="Also write the results to this YAML file.")
def verify(device: str, dtype_name: str, seed: int, seq_len: int, as_json: bool,
           yaml_path: str | None) -> None:
    """Check every HLA form against the explicit float64 sums; exit 1 on any disagreement."""
    if device == "cuda" and not torch.cuda.is_available():
        raise click.BadParameter("no CUDA device here", param_hint="--device")
    if yaml_path:
        try:  # before the checks run, not after
            check_writable(yaml_path)
        except StoreError as error:
            raise click.BadParameter(str(error), param_hint="--yaml") from None
    result = run_all(seed=seed, seq_len=seq_len, dtype_name=dtype_name, device=device)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        render(result, Console())
    if yaml_path:
        try:
            atomic_write_text(yaml_path, yaml.safe_dump(result, sort_keys=False))
        except OSError as error:
            raise click.ClickException(f"cannot write {yaml_path}: {error}") from None
    raise SystemExit(0 if result["passed"] else 1)


commands = [verify]
