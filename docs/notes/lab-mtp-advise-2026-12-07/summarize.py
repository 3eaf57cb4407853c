"""Print the README's table from the advise JSONs beside this file (python summarize.py)."""
import glob
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def pct(x):
    return f"{100 * x:.2f}%"


def name(policy, host):
    return policy + (f" +host {host:g}" if host else "")


def main():
    print("| target | memory | advised (report part) | token hits | extra steps/prompt: advised vs caching off (beyond) "
          "| vLLM's MTP defaults | best found under the step bound (audit) | advised / it "
          "| best found, any steps (audit) | advised / it | >= 0.95 | >= defaults | steps <= off + 0.05 |")
    print("|" + "---|" * 13)
    for path in sorted(glob.glob(os.path.join(HERE, "advise-*.json"))):
        d = json.load(open(path))
        a, au, off = d["advised"], d["audit"], d["caching_off"]
        mem = f"{d['kv_cache_gib']:g} GiB" + (f" + {d['host_cache_gib_max']:g} GiB host"
                                              if d["host_cache_gib_max"] else "")
        ub = au["unconstrained_best"]
        beyond = a["extra_prefill_steps_beyond_off"]
        print(f"| {d['target']} | {mem} | `{name(d['policy'], d['host_cache_gib'])}` "
              f"| {pct(a['token_hit_rate'])} "
              f"| {a['extra_prefill_steps_per_prompt']:.2f} vs {off['extra_prefill_steps_per_prompt']:.2f} ({beyond:+.2f}) "
              f"| {pct(d['default']['token_hit_rate'])} ({d['default']['extra_prefill_steps_beyond_off']:+.2f}) "
              f"| {pct(au['best_token_hit_rate'])} `{name(au['best_policy'], au['best_host_cache_gib'])}` "
              f"({au['best_extra_prefill_steps_beyond_off']:+.2f}) | {au['advised_over_best']:.3f} "
              f"| {pct(ub['token_hit_rate'])} `{name(ub['policy'], ub['host_cache_gib'])}` "
              f"({ub['extra_prefill_steps_beyond_off']:+.2f}) | {au['advised_over_unconstrained_best']:.3f} "
              f"| {'yes' if au['advised_over_best'] >= 0.95 else 'no'} / "
              f"{'yes' if au['advised_over_unconstrained_best'] >= 0.95 else 'no'} "
              f"| {'yes' if a['token_hit_rate'] >= d['default']['token_hit_rate'] else 'no'} "
              f"| {'yes' if a['meets_step_bound'] else 'no'} |")


if __name__ == "__main__":
    main()
