PYINC=$(/work/main/.venv/bin/python -c "import sysconfig;print(sysconfig.get_paths()['include'])")
for f in "$@"; do gcc -O3 -ffp-contract=off -fno-fast-math -march=x86-64-v4 -shared -fPIC -I$PYINC $f.c -o $f.so; gcc -O3 -ffp-contract=off -fno-fast-math -shared -fPIC -I$PYINC $f.c -o ${f}_v1.so; done
for f in "$@"; do gcc -O3 -ffp-contract=off -fno-fast-math -march=x86-64-v3 -shared -fPIC -I$PYINC $f.c -o ${f}_v3.so; done
