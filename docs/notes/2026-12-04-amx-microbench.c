// AMX TDPBSSD microbenchmark behind docs/notes/2026-12-04-amx-prefill.md ("Why not faster").
// Build and run: gcc -O2 -mamx-tile -mamx-int8 -mavx512f 2026-12-04-amx-microbench.c -o amxe
//   ./amxe 1  (dots + tile stores), ./amxe 2 (+ per-block scaling, sums in L1),
//   ./amxe 3 (+ scaling, sums in registers); ns per 16 x 16 block of K = 32, tiles in L1.
//   ./amxe 0 (tile loads, zero and dots only).
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <sys/syscall.h>
#include <unistd.h>
struct __attribute__((aligned(64))) cfg { uint8_t palette, start; uint8_t res[14]; uint16_t colsb[16]; uint8_t rows[16]; };
static double now(){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
int8_t A[8192] __attribute__((aligned(64))), Bm[8192] __attribute__((aligned(64)));
float sx[64*64];
int main(int argc, char** argv){
  int mode = atoi(argv[1]);
  syscall(SYS_arch_prctl, 0x1023, 18);
  struct cfg c; memset(&c,0,64); c.palette=1;
  for(int i=0;i<4;i++){c.rows[i]=16;c.colsb[i]=64;}
  for(int i=4;i<6;i++){c.rows[i]=16;c.colsb[i]=32;}
  for(int i=6;i<8;i++){c.rows[i]=8;c.colsb[i]=64;}
  asm volatile("" ::: "memory");
  _tile_loadconfig(&c);
  int32_t cbuf[2][4][256] __attribute__((aligned(64)));
  float inner[4][256] __attribute__((aligned(64)));
  memset(inner,0,sizeof inner); memset(cbuf,0,sizeof cbuf);
  long n = 2000000; __m512 reg[16]; for(int r=0;r<16;r++) reg[r]=_mm512_setzero_ps();
  double t=now();
  for(long i=0;i<n;i++){
    int k = i & 3;
    _tile_zero(0);_tile_zero(1);_tile_zero(2);_tile_zero(3);
    _tile_loadd(4,A+k*1024,32); _tile_loadd(5,A+k*1024+512,32); _tile_loadd(6,Bm+k*1024,64); _tile_loadd(7,Bm+k*1024+512,64);
    _tile_dpbssd(0,4,6); _tile_dpbssd(1,4,7); _tile_dpbssd(2,5,6); _tile_dpbssd(3,5,7);
    if (mode >= 1) {
      int32_t* o = cbuf[i&1][0];
      _tile_stored(0,o,64);_tile_stored(1,o+256,64);_tile_stored(2,o+512,64);_tile_stored(3,o+768,64);
    }
    if (mode == 2) {
      int32_t (*cb)[256] = cbuf[(i+1)&1];
      for (int tt=0; tt<4; ++tt) for (int r=0;r<16;++r) {
        __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cb[tt]+r*16)), _mm512_set1_ps(sx[(tt*16+r)*8 + k]), _mm512_load_ps(inner[tt]+r*16));
        _mm512_store_ps(inner[tt]+r*16, v);
      }
    }
    if (mode == 3) {
      int32_t (*cb)[256] = cbuf[(i+1)&1];
      for (int tt=0; tt<4; ++tt) for (int r=0;r<16;++r)
        reg[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cb[tt]+r*16)), _mm512_set1_ps(sx[(tt*16+r)*8 + k]), reg[r]);
    }
  }
  double dt=now()-t;
  for(int r=0;r<16;r++) _mm512_store_ps(inner[0]+r*16, _mm512_add_ps(reg[r], _mm512_load_ps(inner[0]+r*16)));
  float s=0; for(int i=0;i<1024;i++) s+=((float*)inner)[i];
  printf("mode %d: %.2f ns per C-tile-block (%g)\n", mode, dt/n/4*1e9, s);
  _tile_release();
}
