"""The PDL placement probe's PTX reading (``benchmarks/probe_pdl_ptx.py``) on a made-up
PTX text: only our kernels' bodies, and where their waits, triggers and first loads sit."""

from __future__ import annotations

from benchmarks.probe_pdl_ptx import kernel_bodies, placement

PTX = """
.visible .entry loop_add_fusion(
  .param .u64 a
)
{
  .reg .b32 %r<3>;
  griddepcontrol.wait;
  ld.global.u32 %r1, [a];
}
.visible .entry rowinv_matvec_o(
  .param .u64 x
)
{
  .reg .b32 %r<9>;
  // a comment
  mov.u32 %r1, %tid.x;
  griddepcontrol.launch_dependents;
  ld.global.nc.v4.u32 {%r2, %r3, %r4, %r5}, [x];
  griddepcontrol.wait;
  ld.global.v4.u32 {%r2, %r3, %r4, %r5}, [x];
  ret;
}
"""


def test_reads_only_our_kernels_and_where_each_instruction_sits():
    bodies = kernel_bodies(PTX)
    assert list(bodies) == ["rowinv_matvec_o"]
    got = placement(bodies["rowinv_matvec_o"])
    assert got == {"instructions": 6, "waits": 1, "launch_dependents": 1, "first_wait": 3,
                   "first_launch_dependents": 1, "first_global_load": 2}


def test_control_a_wait_at_the_entry_reads_as_first():
    lines = ["griddepcontrol.wait;", "ld.global.u32 %r1, [a];"]
    got = placement(lines)
    assert got["first_wait"] == 0 and got["first_global_load"] == 1
