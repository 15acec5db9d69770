// A fused CPU kernel as inductor (torch 2.13) writes its loops, cut down: tests/test_bench.py counts its passes.
extern "C"  void  kernel(const float* in_ptr0, float* out_ptr0, const int64_t ks0, const int64_t ks1)
{
    for (int i = 0; i < 2; i++)
    {
        tmp_acc0_arr[i] = 0;
    }
    #pragma omp parallel
    {
        #pragma omp for
        for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(ks0*ks1); x0+=static_cast<int64_t>(16L))
        {
            if(x0 < static_cast<int64_t>(16L*(c10::div_floor_integer(static_cast<int64_t>(ks0*ks1), static_cast<int64_t>(16L)))))
            {
                for (long x0_inner = 0; x0_inner < static_cast<int64_t>(16); x0_inner++) { tmp[x0_inner] = 0; }
            }
            else
            {
                for (int64_t x0_tail = static_cast<int64_t>(16L*(c10::div_floor_integer(static_cast<int64_t>(ks0*ks1), static_cast<int64_t>(16L))));x0_tail < static_cast<int64_t>(ks0*ks1); x0_tail++)
                {
                    out_ptr0[x0_tail] = in_ptr0[x0_tail];
                }
            }
        }
        #pragma omp for
        for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(ks0); x0+=static_cast<int64_t>(1L))
        {
            for(int64_t x1=static_cast<int64_t>(0L); x1<static_cast<int64_t>(ks1); x1+=static_cast<int64_t>(16L))
            {
                out_ptr0[x0] += in_ptr0[x1 + ks1*x0];
            }
        }
        #pragma omp for
        for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(ks0); x0+=static_cast<int64_t>(16L))
        {
            out_ptr0[x0] = 0;
        }
    }
    for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(8194L); x0+=static_cast<int64_t>(1L))
    {
        for (int tid = 0; tid < 2; tid++) { out_ptr0[x0] += 1; }
    }
}
