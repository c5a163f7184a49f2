"""The bench's collective table (bench/model/_hw_source.py): every collective constant the bench uses is in it, each
labelled documented or ASSUMPTION with a source, and the bench's CollectiveParams come from it alone."""

from dataclasses import fields

from bench.model import _hw_source as hw
from bench.model.collectives import CollectiveParams
from nkisim import hardware as table


def test_every_collective_param_is_in_the_table_with_a_status_and_source():
    rows = {r["key"]: r for r in hw.collective_table()}
    assert set(rows) == {f.name for f in fields(CollectiveParams)}
    for r in rows.values():
        assert r["status"] in ("documented", "documented example", "ASSUMPTION"), r
        assert r["source"].strip(), r
    # the modelled defaults are labelled as such
    assert rows["alpha_base_s"]["status"] == "ASSUMPTION"
    assert rows["busbw_mesh"]["status"] == rows["busbw_rdh"]["status"] == "ASSUMPTION"
    assert "ASSUMPTION" in rows["busbw_kangaring"]["source"]      # trn3 reuses the trn2 anchor


def test_bench_params_come_from_the_table_which_re_exports_the_one_written_copy():
    rows = hw.collective_table()
    for inst in hw.build_instances():
        assert inst.collectives == CollectiveParams(**{r["key"]: r[inst.target] for r in rows})
        c = table.HARDWARE[inst.target].collective
        bw = table.COLLECTIVE_BUSBW[inst.target]
        assert (inst.collectives.alpha_hop_s, inst.collectives.alpha_base_s) == (c.hop_latency_s, c.base_latency_s)
        assert (inst.collectives.busbw_mesh, inst.collectives.busbw_rdh, inst.collectives.busbw_kangaring) == \
            (bw["Mesh"], bw["RDH"], bw["KangaRing"])


def test_report_constants_rows_carry_the_collective_status():
    coll = [r for r in hw.hardware_rows() if r["item"] in {i for _, i, _ in hw.COLLECTIVE_ITEMS}]
    assert len(coll) == len(hw.COLLECTIVE_ITEMS)
    assert all(r["source"].startswith("[") for r in coll)
