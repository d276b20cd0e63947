#!/bin/bash
# The [fast] extra's kernels on a lent GPU machine, from wheels a call carried (issue 56).
#
# nvidia-cutlass-dsl's compiler (nvidia-cutlass-dsl-libs-cu13: a 92 MB wheel, 237 MB unpacked; the
# MLIR/LLVM compiler .so alone 193 MB, already stripped) does not fit one call's 64 MiB with the
# tree and the other wheels, so it travels xz-compressed, in two calls when need be:
#   .whl/cute/ir.so.xz   the compiler (_cutlass_ir.cu13...so), ~51 MB
#   .whl/cute/rt.so.xz   libcute_dsl_runtime.so, ~13.5 MB
#   .whl/cute/cu13-small.tar  the rest of that wheel (a few files)
#   .whl/fast/*.whl      nvidia-cutlass-dsl, -libs-base, -libs-core, apache-tvm-ffi, quack-kernels, flash-attn-4
#   .whl/base/*.whl      pydantic and its needs (fleet itself)
# Each piece found is unpacked to /tmp/cute-stage (kept while the machine stays warm); once all
# are there, everything is pip-installed into the machine's python (the workers fleet starts use it).
set -u
W=${1:-.whl}
STAGE=/tmp/cute-stage
mkdir -p $STAGE
for piece in ir rt; do
  if [ -f $W/cute/$piece.so.xz ] && [ ! -f $STAGE/$piece.so ]; then
    python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2]+'.part','wb'), 1<<24)" \
      $W/cute/$piece.so.xz $STAGE/$piece.so && mv $STAGE/$piece.so.part $STAGE/$piece.so && echo "fast_install: staged $piece"
  fi
done
[ -f $W/cute/cu13-small.tar ] && cp $W/cute/cu13-small.tar $STAGE/
ls $W/base/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir $W/base/*.whl
if ! ls $W/fast/*.whl >/dev/null 2>&1; then echo "fast_install: no fast wheels in this call"; exit 0; fi
for f in ir.so rt.so cu13-small.tar; do
  [ -f $STAGE/$f ] || { echo "fast_install: $f missing (a fresh machine?): fast kernels not installed"; exit 0; }
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir $W/fast/*.whl || exit 0
SITE=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
tar -xf $STAGE/cu13-small.tar -C $SITE
cp $STAGE/ir.so $SITE/nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so
cp $STAGE/rt.so $SITE/nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so
python3 -c "import cutlass, quack; print('fast_install: cutlass', getattr(cutlass, '__version__', '?'), 'quack', getattr(quack, '__version__', '?'))" 2>&1 | tail -3
